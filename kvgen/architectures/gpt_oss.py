"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with q/k/v/o biases and a learned sink logit per head,
sliding-window (128) layers alternating with full ones, YaRN RoPE, and a mixture of experts in place of
the MLP: a router with a bias, softmax over its top-k logits, experts with biases and a clamped SwiGLU.

    GGUF blk.N.attn_sinks.weight          ->  model.layers.N.self_attn.sinks
         blk.N.post_attention_norm        ->  model.layers.N.post_attention_layernorm
         blk.N.ffn_gate_inp               ->  model.layers.N.mlp.router
         blk.N.ffn_{gate,up,down}_exps    ->  model.layers.N.mlp.experts.{gate,up,down}_proj (weight, bias)

transformers stores the experts as `gate_up_proj` [experts, hidden, 2 * inner] with gate and up
columns interleaved (kvgen.loaders.experts splits them); llama.cpp's converter writes them split. What
a GGUF does not say, kvgen takes as llama.cpp does: even layers slide their window, alpha 1.702 and
limit 7.0; and YaRN's correction range untruncated, as gpt-oss's config says (llama.cpp rounds it).
"""

from typing import Any

from kvgen.architectures.mixture import moe_gguf_fields, moe_hf_fields
from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_MOE_NAMES, Architecture, AttentionSpec, Branch,
                                      LayerSpec, MoESpec)

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's constants for gpt-oss (its GGUF has no such keys)


def alternating_windows(num_layers: int, window: int) -> tuple[int | None, ...]:
    """Even layers slide `window`, odd ones are global (gpt-oss's default layer_types, llama.cpp's pattern)."""
    return tuple(window if i % 2 == 0 else None for i in range(num_layers))


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    """Windows from `layer_types`, the experts (their width is `intermediate_size`: no dense MLP), the
    SwiGLU's constants. Top-k logits softmaxed among themselves are the renormalised top-k of the softmax."""
    window = int(cfg.get("sliding_window") or 128)
    if cfg.get("layer_types"):
        windows = tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"])
    else:
        windows = alternating_windows(config.num_layers, window)
    return moe_hf_fields(cfg, "intermediate_size") | dict(
        norm_topk_prob=True, sliding_window=None, layer_windows=windows,
        swiglu_alpha=float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
        swiglu_limit=float(cfg.get("swiglu_limit", SWIGLU_LIMIT)))


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    """The same from GGUF metadata (`p`: "gpt-oss.")."""
    windows = alternating_windows(config.num_layers, int(meta[p + "attention.sliding_window"]))
    rope = config.rope_scaling and {**config.rope_scaling, "truncate": False}
    return moe_gguf_fields(p, meta, norm_topk_prob=True) | dict(
        sliding_window=None, layer_windows=windows, rope_scaling=rope, swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT)


ARCHITECTURE = Architecture(
    name="gpt-oss",
    hf_model_types=("gpt_oss",),
    gguf_name="gpt-oss",
    layer=LayerSpec((Branch("input_layernorm", AttentionSpec(sink_logits=True)),
                     Branch("post_attention_layernorm",
                            MoESpec(router="router", biases=True, activation="clamped_swiglu",
                                    hf_interleaved=True)))),
    gguf_names=GGUF_BLOCK_NAMES | GGUF_MOE_NAMES | {
        "post_attention_norm": "post_attention_layernorm", "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp": "mlp.router"},
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
