"""Gemma 3 text models (270M to 27B).

    layer:  x += rms_norm(attention(rms_norm(x)))     input_layernorm, post_attention_layernorm
            x += rms_norm(geglu_mlp(rms_norm(x)))     pre_feedforward_layernorm, post_feedforward_layernorm

Attention with QK-norm; norms multiply by (1 + w) (HF stores w, GGUF 1 + w); embeddings times
sqrt(hidden); five sliding-window layers to one global, each kind with its own RoPE base; a query
scale of its own; optional final logit soft-capping. What a GGUF does not say (the window pattern,
the local RoPE base in older files, the 27B's query scale), kvgen takes from llama.cpp's code.
"""

from typing import Any

from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_QK_NORM_NAMES, Architecture, AttentionSpec, Branch,
                                      GatedMLPSpec, LayerSpec, float32_value, rope_parameters,
                                      rope_scaling)

SLIDING_PATTERN = 6  # every sixth layer is global, the others slide their window
LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa where the GGUF has no rope.freq_base_swa
LAYERS_OF_27B = 62  # llama.cpp scales the 27B's queries by hidden / heads, not the head size


def layer_windows(num_layers: int, window: int, pattern: int = SLIDING_PATTERN) -> tuple[int | None, ...]:
    """Every `pattern`-th layer is global (None), the others slide `window`."""
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    """The windows, the local RoPE base, the query scale and the logit cap of an HF config."""
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping is not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    window = int(cfg.get("sliding_window") or 4096)
    if cfg.get("layer_types"):
        windows = tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"])
    else:
        windows = layer_windows(config.num_layers, window, int(cfg.get("sliding_window_pattern", SLIDING_PATTERN)))
    local = rope_parameters(cfg, "sliding_attention")
    if rope_scaling(local) is not None:
        raise ValueError("RoPE scaling on sliding-window layers is not supported")
    scalar = float(cfg.get("query_pre_attn_scalar") or config.head_dim)
    cap = cfg.get("final_logit_softcapping")
    return dict(sliding_window=None, layer_windows=windows,
                local_rope_theta=float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0),
                attention_scale=scalar ** -0.5, final_logit_softcap=float(cap) if cap else None)


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    """The same from GGUF metadata (`p`: "gemma3."), as llama.cpp sets what the file leaves out."""
    window = int(meta[p + "attention.sliding_window"])
    scaled_by = config.hidden_size // config.num_heads if config.num_layers == LAYERS_OF_27B else config.head_dim
    cap = meta.get(p + "final_logit_softcapping")
    return dict(sliding_window=None, layer_windows=layer_windows(config.num_layers, window),
                local_rope_theta=float32_value(meta.get(p + "rope.freq_base_swa", LOCAL_ROPE_THETA)),
                attention_scale=scaled_by ** -0.5, final_logit_softcap=float32_value(cap) if cap else None)


ARCHITECTURE = Architecture(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_name="gemma3",
    layer=LayerSpec((
        Branch("input_layernorm", AttentionSpec(qk_norm=True), out_norm="post_attention_layernorm"),
        Branch("pre_feedforward_layernorm", GatedMLPSpec(activation="gelu_tanh"),
               out_norm="post_feedforward_layernorm"),
    )),
    embedding_scale=True,
    norm_plus_one=True,
    tied_by_default=True,
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES | {
        "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm"},
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
