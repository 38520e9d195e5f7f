"""What a Gemma 4 HF config (Gemma4TextConfig) and GGUF metadata (llama.cpp's converter) say, as
ModelConfig fields (the architecture itself: kvgen.architectures.gemma4).

GGUF: the window pattern is attention.sliding_window_pattern; key_length is the global layers' head
size and key_length_swa the window layers'; head_count_kv and feed_forward_length may be per layer;
the global layers' partial RoPE is a `rope_freqs` tensor (factor 1 for the rotated pairs, 1e30 for
the others), which the GGUF loader reads back as proportional RoPE.
"""

from __future__ import annotations

from typing import Any

from kvgen.architectures.spec import float32_value, kv_donors, rope_parameters, rope_scaling

SLIDING, FULL = "sliding_attention", "full_attention"
MOE_REFUSAL = "Gemma 4 MoE (enable_moe_block) is not supported yet: MoE arrives with issue 43"


def _per_kind(types: list[str], sliding: int, full: int) -> tuple[int, ...]:
    return tuple(sliding if kind == SLIDING else full for kind in types)


def _global_override(cfg: dict[str, Any], key: str) -> Any:
    """A global layer's value of `key` from per_layer_config (how transformers saves global_head_dim
    and num_global_key_value_heads), or None."""
    types = cfg["layer_types"]
    return next((c[key] for i, c in (cfg.get("per_layer_config") or {}).items()
                 if types[int(i)] == FULL and key in c), None)


def _global_shape(cfg: dict[str, Any], config: Any) -> tuple[int, int]:
    """The global layers' head size and KV heads as transformers resolves them: from a saved
    per_layer_config, else from global_head_dim (512 by default) and, where attention_k_eq_v is set,
    num_global_key_value_heads."""
    if "per_layer_config" in cfg:
        return (int(_global_override(cfg, "head_dim") or config.head_dim),
                int(_global_override(cfg, "num_key_value_heads") or config.num_kv_heads))
    heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    return int(cfg.get("global_head_dim") or 512), int(heads or config.num_kv_heads)


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    """Windows, head sizes, KV sharing, RoPE of each kind and per-layer inputs of a Gemma4TextConfig."""
    if cfg.get("enable_moe_block"):
        raise ValueError(MOE_REFUSAL)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 4 with use_bidirectional_attention is not supported (kvgen decodes causally)")
    activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 4 with activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    n = config.num_layers
    types = list(cfg.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
    types[-1] = FULL  # as transformers forces it
    cfg = cfg | {"layer_types": types}
    full_dim, full_heads = _global_shape(cfg, config)
    local, full = rope_parameters(cfg, SLIDING), rope_parameters(cfg, FULL)
    if rope_scaling(local) is not None:
        raise ValueError("RoPE scaling on sliding-window layers is not supported")
    width = int(cfg.get("hidden_size_per_layer_input") or 0)
    cap = cfg.get("final_logit_softcapping")
    return dict(
        sliding_window=None, layer_windows=tuple(int(cfg["sliding_window"]) if t == SLIDING else None for t in types),
        layer_head_dims=_per_kind(types, config.head_dim, full_dim),
        layer_kv_heads=_per_kind(types, config.num_kv_heads, full_heads),
        layer_kv_donors=tuple(kv_donors(types, int(cfg.get("num_kv_shared_layers") or 0))),
        rope_theta=float(full.get("rope_theta", 1000000.0)), rope_scaling=rope_scaling(full),
        local_rope_theta=float(local.get("rope_theta", 10000.0)), attention_scale=1.0,
        final_logit_softcap=float(cap) if cap else None, per_layer_input_size=width,
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or 0) if width else 0,
        attention_k_eq_v=bool(cfg.get("attention_k_eq_v")), double_wide_mlp=bool(cfg.get("use_double_wide_mlp")))


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    """The same from GGUF metadata (`p`: "gemma4."); the global layers' partial RoPE is read by the
    loader from rope_freqs (`rope_scaling`), their head size is `config.head_dim` (key_length)."""
    if meta.get(p + "expert_count"):
        raise ValueError(MOE_REFUSAL)
    pattern = meta[p + "attention.sliding_window_pattern"]
    types = [SLIDING if is_swa else FULL for is_swa in pattern]
    window = int(meta[p + "attention.sliding_window"])
    kv_heads = meta.get(p + "attention.head_count_kv", config.num_heads)
    kv_heads = list(kv_heads) if isinstance(kv_heads, list) else [int(kv_heads)] * len(types)
    local_dim = int(meta.get(p + "attention.key_length_swa", config.head_dim))
    donors = kv_donors(types, int(meta.get(p + "attention.shared_kv_layers", 0)))
    cap = meta.get(p + "final_logit_softcapping")
    width = int(meta.get(p + "embedding_length_per_layer_input") or 0)
    widths = meta[p + "feed_forward_length"]
    wide = isinstance(widths, list) and len(set(widths)) > 1
    if wide and widths != [config.intermediate_size * (1 if d == i else 2) for i, d in enumerate(donors)]:
        raise ValueError(f"feed_forward_length {widths} is not Gemma 4's double-wide MLP on the sharing layers")
    return dict(
        head_dim=local_dim, num_kv_heads=int(kv_heads[types.index(SLIDING)] if SLIDING in types else kv_heads[0]),
        sliding_window=None, layer_windows=tuple(window if t == SLIDING else None for t in types),
        layer_head_dims=_per_kind(types, local_dim, config.head_dim), layer_kv_heads=tuple(int(h) for h in kv_heads),
        layer_kv_donors=tuple(donors), local_rope_theta=float32_value(meta.get(p + "rope.freq_base_swa", 10000.0)),
        attention_scale=1.0, final_logit_softcap=float32_value(cap) if cap else None, per_layer_input_size=width,
        per_layer_vocab_size=config.vocab_size if width else 0, double_wide_mlp=wide)


def gguf_tensor_fields(names: set[str], config: Any) -> dict[str, Any]:
    """attention_k_eq_v where a global layer holding K/V has no attn_v (llama.cpp then takes V = K)."""
    holders = [i for i in range(config.num_layers) if config.kv_donor(i) == i and config.window(i) is None]
    return {"attention_k_eq_v": any(f"blk.{i}.attn_v.weight" not in names for i in holders)}
