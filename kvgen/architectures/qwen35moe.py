"""Qwen3.5-MoE text models (Qwen3.5-35B-A3B, ...): Qwen3.5's layers (kvgen.architectures.qwen35: Gated
DeltaNet and gated attention) with a mixture of experts in place of every layer's MLP: softmax router,
top-k always renormalised (transformers' Qwen3_5MoeTopKRouter; llama.cpp's qwen35moe likewise), and a
shared expert scaled by sigmoid of its gate (Qwen2-MoE's block).

    GGUF blk.N.ffn_gate_inp, ffn_{gate,up,down}_exps   ->  model.layers.N.mlp.gate, mlp.experts.*
         blk.N.ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp  ->  mlp.shared_expert.*, mlp.shared_expert_gate

The configs have no dense MLP width (no intermediate_size, no feed_forward_length).
"""

from typing import Any

from kvgen.architectures import qwen35
from kvgen.architectures.mixture import moe_gguf_fields, moe_hf_fields
from kvgen.architectures.spec import (GGUF_MOE_NAMES, GGUF_SHARED_EXPERT_NAMES, Architecture, Branch,
                                      GatedAttentionSpec, GatedDeltaNetSpec, LayerSpec, MoESpec)

MOE = Branch("post_attention_layernorm", MoESpec(shared_expert=True))
FULL, LINEAR = (LayerSpec((Branch("input_layernorm", b), MOE)) for b in (GatedAttentionSpec(), GatedDeltaNetSpec()))


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    return qwen35.hf_fields(cfg, config) | moe_hf_fields(cfg | {"norm_topk_prob": True}, "moe_intermediate_size") | \
        dict(shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]))


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    return qwen35.gguf_fields(p, meta, config) | moe_gguf_fields(p, meta, norm_topk_prob=True) | \
        dict(shared_expert_intermediate_size=int(meta[p + "expert_shared_feed_forward_length"]))


ARCHITECTURE = Architecture(
    name="qwen35moe", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"), gguf_name="qwen35moe", layer=FULL,
    layer_of=lambda i, config: LINEAR if i in config.recurrent_layers else FULL, norm_plus_one=True,
    gguf_names=dict(qwen35.ARCHITECTURE.gguf_names) | GGUF_MOE_NAMES | GGUF_SHARED_EXPERT_NAMES,
    hf_fields=hf_fields, gguf_fields=gguf_fields, plain_norms=qwen35.ARCHITECTURE.plain_norms,
)
