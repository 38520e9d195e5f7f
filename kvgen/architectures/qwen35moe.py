"""Qwen3.5-MoE text models (Qwen3.5-35B-A3B, ...): Qwen3.5's layers (kvgen.architectures.qwen35: Gated
DeltaNet and gated attention) with a mixture of experts in place of the MLP: softmax router, top-k
always renormalised, and a shared expert scaled by sigmoid of its gate (Qwen2-MoE's block).

From HF directories (`model_type` qwen3_5_moe_text). Its GGUF (`qwen35moe`) is refused for now
(kvgen.architectures.NOT_YET): no fixture of it could be converted yet (tests/loaders/arch_fixtures.py
says why), so no reading of one is checked against transformers.
"""

from typing import Any

from kvgen.architectures import qwen35
from kvgen.architectures.mixture import moe_hf_fields
from kvgen.architectures.spec import (GGUF_MOE_NAMES, GGUF_SHARED_EXPERT_NAMES, Architecture, Branch,
                                      GatedAttentionSpec, GatedDeltaNetSpec, LayerSpec, MoESpec)

MOE = Branch("post_attention_layernorm", MoESpec(shared_expert=True))
FULL, LINEAR = (LayerSpec((Branch("input_layernorm", b), MOE)) for b in (GatedAttentionSpec(), GatedDeltaNetSpec()))


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    return qwen35.hf_fields(cfg, config) | moe_hf_fields(cfg | {"norm_topk_prob": True}, "moe_intermediate_size") | \
        dict(shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]))


ARCHITECTURE = Architecture(
    name="qwen35moe", hf_model_types=("qwen3_5_moe_text",), gguf_name="qwen35moe", layer=FULL,
    layer_of=lambda i, config: LINEAR if i in config.recurrent_layers else FULL, norm_plus_one=True,
    gguf_names=dict(qwen35.ARCHITECTURE.gguf_names) | GGUF_MOE_NAMES | GGUF_SHARED_EXPERT_NAMES,
    hf_fields=hf_fields, plain_norms=qwen35.ARCHITECTURE.plain_norms,
)
