"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a mixture of
experts beside a shared expert: softmax router, top-k (renormalised where the config says), plus
sigmoid(shared_expert_gate . x) times a gated MLP every token runs.

    GGUF blk.N.ffn_gate_inp_shexp          ->  model.layers.N.mlp.shared_expert_gate
         blk.N.ffn_{gate,up,down}_shexp    ->  model.layers.N.mlp.shared_expert.{gate,up,down}_proj
"""

from typing import Any

from kvgen.architectures.mixture import moe_gguf_fields, moe_hf_fields
from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_MOE_NAMES, GGUF_SHARED_EXPERT_NAMES, Architecture,
                                      AttentionSpec, Branch, LayerSpec, MoESpec, sliding_window_if_used)


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("Qwen2-MoE with dense MLP layers (mlp_only_layers, decoder_sparse_step) is not supported")
    return (sliding_window_if_used(cfg, config) | moe_hf_fields(cfg, "moe_intermediate_size")
            | dict(shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"])))


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    return moe_gguf_fields(p, meta, norm_topk_prob=False) | dict(
        shared_expert_intermediate_size=int(meta[p + "expert_shared_feed_forward_length"]))


ARCHITECTURE = Architecture(
    name="qwen2moe",
    hf_model_types=("qwen2_moe",),
    gguf_name="qwen2moe",
    layer=LayerSpec((Branch("input_layernorm", AttentionSpec(qkv_bias=True)),
                     Branch("post_attention_layernorm", MoESpec(shared_expert=True)))),
    gguf_names=GGUF_BLOCK_NAMES | GGUF_MOE_NAMES | GGUF_SHARED_EXPERT_NAMES,
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
