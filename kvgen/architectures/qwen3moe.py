"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head QK-norm) and, in place of
the MLP, a mixture of experts: softmax router, top-k renormalised, no shared expert.

    GGUF blk.N.ffn_gate_inp          ->  model.layers.N.mlp.gate
         blk.N.ffn_{gate,up,down}_exps  ->  model.layers.N.mlp.experts.{gate,up,down}_proj (stacked)
"""

from typing import Any

from kvgen.architectures.mixture import moe_gguf_fields, moe_hf_fields
from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_MOE_NAMES, GGUF_QK_NORM_NAMES, Architecture,
                                      AttentionSpec, Branch, LayerSpec, MoESpec, sliding_window_if_used)


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("Qwen3-MoE with dense MLP layers (mlp_only_layers, decoder_sparse_step) is not supported")
    return sliding_window_if_used(cfg, config) | moe_hf_fields(cfg, "moe_intermediate_size")


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    return moe_gguf_fields(p, meta, norm_topk_prob=True)


ARCHITECTURE = Architecture(
    name="qwen3moe",
    hf_model_types=("qwen3_moe",),
    gguf_name="qwen3moe",
    layer=LayerSpec((Branch("input_layernorm", AttentionSpec(qk_norm=True)),
                     Branch("post_attention_layernorm", MoESpec()))),
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES | GGUF_MOE_NAMES,
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
