"""What the mixture-of-experts architectures read from their configs: the experts' count, width and
routing (kvgen.architectures.spec.MoESpec), from a HF config and from GGUF metadata."""

from __future__ import annotations

from typing import Any


def moe_hf_fields(cfg: dict[str, Any], inner_key: str) -> dict[str, Any]:
    """The ModelConfig fields of a HF config's routed experts; `inner_key` names the experts' width."""
    return dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg[inner_key]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def moe_gguf_fields(p: str, meta: dict[str, Any], norm_topk_prob: bool) -> dict[str, Any]:
    """The same from GGUF metadata (`p`: "qwen3moe."); the renormalisation is the architecture's
    (llama.cpp fixes it per architecture unless the file says `expert_weights_norm`)."""
    inner = meta[p + "expert_feed_forward_length"] if p + "expert_feed_forward_length" in meta else \
        meta[p + "feed_forward_length"]
    return dict(num_experts=int(meta[p + "expert_count"]), experts_per_token=int(meta[p + "expert_used_count"]),
                expert_intermediate_size=int(inner),
                norm_topk_prob=bool(meta.get(p + "expert_weights_norm", norm_topk_prob)))
