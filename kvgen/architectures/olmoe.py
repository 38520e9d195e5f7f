"""OLMoE (allenai/OLMoE-1B-7B): Llama's attention with QK-norm over the whole q and k projections
(one RMSNorm across all heads, not per head) and a mixture of experts: softmax router, top-k
weights used as they are (not renormalised).
"""

from typing import Any

from kvgen.architectures.mixture import moe_gguf_fields, moe_hf_fields
from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_MOE_NAMES, GGUF_QK_NORM_NAMES, Architecture,
                                      AttentionSpec, Branch, LayerSpec, MoESpec)


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    if cfg.get("clip_qkv") is not None:
        raise ValueError("OLMoE with clip_qkv is not supported")
    return moe_hf_fields(cfg, "intermediate_size")


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    return moe_gguf_fields(p, meta, norm_topk_prob=False)


ARCHITECTURE = Architecture(
    name="olmoe",
    hf_model_types=("olmoe",),
    gguf_name="olmoe",
    layer=LayerSpec((Branch("input_layernorm", AttentionSpec(qk_norm=True, qk_norm_whole=True)),
                     Branch("post_attention_layernorm", MoESpec()))),
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES | GGUF_MOE_NAMES,
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
