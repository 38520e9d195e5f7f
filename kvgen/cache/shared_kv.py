"""KV shared across layers (Gemma 4's `num_kv_shared_layers`): which layer's K/V each layer attends over,
and what a sequence's KV then takes. No torch here (kv-size and sizing use it).

In Gemma 4 the last `num_kv_shared_layers` layers compute no K/V: each attends over the K/V of the last
earlier non-sharing layer of its own kind (sliding or full), its *donor* (transformers'
Gemma4TextConfig.kv_sharing_modes: "store" on the donors, "reuse" on the sharers; llama.cpp reuses the
same layers). So a sharing layer allocates no blocks of its own and reads its donor's: the cache holds
the donors only, and a sharing sliding layer sees the donor's window, which is its own (one window per
kind).

    Gemma 4 E2B: 35 layers, 4 sliding : 1 full, the last 20 sharing ->
        donors 0-14 (12 sliding, 3 full) hold K/V; layers 15-34 read layer 13 (sliding) or 14 (full)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.architectures.spec import kv_donors
from kvgen.cache.sizing import kv_bytes_per_token

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class SharedKVShape:
    """Attention layers of two kinds (head size and KV heads per kind, a window for the sliding one),
    the last ones sharing K/V."""

    layer_types: tuple[str, ...]
    num_kv_shared_layers: int
    head_dim: dict[str, int]
    kv_heads: dict[str, int]
    window: int

    @classmethod
    def from_hf_config(cls, config: dict) -> SharedKVShape:
        """From a Gemma 4 config.json (`gemma4_text`, or the text_config of a `gemma4` one)."""
        config = config.get("text_config", config)
        n = config["num_hidden_layers"]
        types = config.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        full_overrides = next((c for i, c in (config.get("per_layer_config") or {}).items()
                               if types[int(i)] == FULL), {})
        full_dim = config.get("global_head_dim") or full_overrides.get("head_dim") or config["head_dim"]
        full_heads = config.get("num_global_key_value_heads") or full_overrides.get("num_key_value_heads") \
            or config["num_key_value_heads"]
        return cls(tuple(types), config.get("num_kv_shared_layers", 0), {SLIDING: config["head_dim"], FULL: full_dim},
                   {SLIDING: config["num_key_value_heads"], FULL: full_heads}, config["sliding_window"])

    @classmethod
    def from_model_config(cls, config) -> SharedKVShape | None:
        """From a kvgen.config.ModelConfig (a GGUF's too) whose layers share K/V, else None."""
        if not config.layer_kv_donors or config.kv_holders == list(range(config.num_layers)):
            return None
        types = tuple(SLIDING if config.window(i) is not None else FULL for i in range(config.num_layers))
        first = {kind: types.index(kind) for kind in set(types)}
        return cls(types, config.num_layers - len(config.kv_holders),
                   {kind: config.head_dim_of(i) for kind, i in first.items()},
                   {kind: config.kv_heads_of(i) for kind, i in first.items()},
                   next(w for i in range(config.num_layers) if (w := config.window(i)) is not None))

    @property
    def donors(self) -> list[int]:
        return kv_donors(list(self.layer_types), self.num_kv_shared_layers)

    def holders(self) -> list[int]:
        """The layers whose K/V the cache holds (each donor once)."""
        return sorted(set(self.donors))

    def kind_bytes_per_token(self, kind: str, dtype_bytes: int = 4) -> int:
        """One layer of `kind`'s K/V bytes per token."""
        return kv_bytes_per_token(1, self.kv_heads[kind], self.head_dim[kind], dtype_bytes)

    def sequence_bytes(self, tokens: int, dtype_bytes: int = 4, shared: bool = True, block_size: int = 1) -> int:
        """K/V one sequence of `tokens` tokens holds: sliding layers their window (rounded up to whole
        blocks of `block_size`, plus one for a window that straddles blocks), full layers every token;
        with `shared`, the holders only, else every layer."""
        layers = self.holders() if shared else range(len(self.layer_types))
        held = {FULL: tokens, SLIDING: min(tokens, self.window if block_size == 1 else
                                           (-(-self.window // block_size) + 1) * block_size)}
        return sum(held[self.layer_types[i]] * self.kind_bytes_per_token(self.layer_types[i], dtype_bytes)
                   for i in layers)

    def report(self, tokens: int, dtype_bytes: int = 4) -> dict:
        holders = self.holders()
        shared, unshared = self.sequence_bytes(tokens, dtype_bytes), self.sequence_bytes(tokens, dtype_bytes, False)
        return {"layers": len(self.layer_types), "holders": len(holders),
                "sharing_layers": len(self.layer_types) - len(holders), "tokens": tokens,
                "kv_bytes": shared, "kv_bytes_unshared": unshared, "ratio": shared / unshared,
                "holders_by_kind": {kind: sum(self.layer_types[i] == kind for i in holders) for kind in (SLIDING, FULL)}}


def shared_kv_shape_of(path) -> SharedKVShape | None:
    """The SharedKVShape of a Gemma 4 HF directory or config.json with sharing layers, else None."""
    import json
    from pathlib import Path

    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if config_file.name != "config.json" or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("model_type") not in ("gemma4", "gemma4_text"):
        return None
    return SharedKVShape.from_hf_config(config)


def describe(report: dict) -> list[str]:
    """SharedKVShape.report as `kvgen kv-size` prints it."""
    from kvgen.cache.sizing import format_bytes

    kinds = ", ".join(f"{n} {kind.split('_')[0]}" for kind, n in report["holders_by_kind"].items())
    return [f"{report['layers']} layers, {report['sharing_layers']} of them reading an earlier layer's K/V: "
            f"{report['holders']} hold K/V ({kinds})",
            f"{report['tokens']:,} tokens: {report['kv_bytes']:,} bytes ({format_bytes(report['kv_bytes'])}), "
            f"{report['ratio']:.1%} of every layer holding its own ({format_bytes(report['kv_bytes_unshared'])})"]
