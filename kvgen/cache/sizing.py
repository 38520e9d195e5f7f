"""KV-cache memory arithmetic: bytes per token, parsing and printing sizes, blocks per budget, and
the engine's KV plan (how many blocks each pool gets: `plan_kv`).

Size units (case-insensitive, optional "B", optional space):
  binary   Ki Mi Gi Ti Pi  (KiB, MiB, ...) = 1024^k
  decimal  K  M  G  T  P   (KB,  MB,  ...) = 1000^k   -- SI, as disks and `format_bytes` use
So "2GiB" = 2 * 1024**3 and "1.5G" = 1_500_000_000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvgen.cache.hybrid import HybridKVManager, LayerKind, layer_kinds, sequence_bytes, split_budget
from kvgen.cache.kv_manager import KVCacheManager
from kvgen.config import DEFAULT_KV_MEMORY, EngineConfig, ModelConfig

_PREFIXES = "KMGTP"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([kmgtp]i?)?b?\s*$", re.IGNORECASE)


# Bytes of one element of the KV pools, by `--kv-cache-dtype` name; int8 and fp8 (e4m3) also store
# float32 scales (kv_scale_bytes).
KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
QUANTIZED_KV = ("int8", "fp8")


def kv_scale_bytes(kv_dtype: str, head_dim: int) -> int:
    """Scale bytes of one (token, KV head), K's and V's together: a float32 per 16 dimensions of the
    key (kvgen.model.kv_quant.key_groups) and one for the value in int8 / fp8 pools, else 0."""
    if kv_dtype not in QUANTIZED_KV:
        return 0
    from kvgen.model.kv_quant import key_groups  # torch, only for quantized pools

    return 4 * (key_groups(head_dim) + 1)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """Bytes one token's K and V take across all layers: layers * kv_heads * (2 * head_dim * bytes +
    scale_bytes), scale_bytes being K's and V's scales of one (token, head) together."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return num_layers * num_kv_heads * (2 * head_dim * dtype_bytes + scale_bytes)


def kv_bytes_per_token_of(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """`kv_bytes_per_token` for a pool dtype named as `--kv-cache-dtype` names it (resolved, not auto)."""
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, KV_ELEMENT_BYTES[kv_dtype],
                              kv_scale_bytes(kv_dtype, head_dim))


def parse_bytes(size: str | int) -> int:
    """Parses "2GiB", "512MB", "1.5G", "1000" (see the module docstring for units) into bytes."""
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size must be >= 0 bytes, got {size}")
        return size
    match = _SIZE_RE.match(size)
    if match is None:
        raise ValueError(f"cannot parse size {size!r}: expected a number with an optional unit "
                         "such as 512MB, 1.5G or 2GiB")
    number, exponent, unit = match.groups()
    value = Fraction(number) * Fraction(10) ** int(exponent or 0) * _unit_multiplier(unit or "")
    if value.denominator != 1:
        raise ValueError(f"size {size!r} is not a whole number of bytes")
    return int(value)


def _unit_multiplier(unit: str) -> int:
    if not unit:
        return 1
    power = _PREFIXES.index(unit[0].upper()) + 1
    return 1024 ** power if unit.lower().endswith("i") else 1000 ** power


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks of `block_size` tokens fit in `budget_bytes`."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if block_size <= 0 or bytes_per_token <= 0:
        raise ValueError(f"block_size and bytes_per_token must be positive, got {block_size}, {bytes_per_token}")
    return budget_bytes // (block_size * bytes_per_token)


def format_bytes(n: int, binary: bool = False) -> str:
    """Human-readable size with one decimal: "32.8 GB" (powers of 1000) or "30.5 GiB" (of 1024)."""
    if n < 0:
        return "-" + format_bytes(-n, binary)
    base = 1024 if binary else 1000
    if n < base:
        return f"{n} B"
    suffix = "iB" if binary else "B"
    value = n / base
    for prefix in _PREFIXES[:-1]:
        if round(value, 1) < base:
            return f"{value:.1f} {prefix}{suffix}"
        value /= base
    return f"{value:.1f} {_PREFIXES[-1]}{suffix}"


@dataclass(frozen=True)
class KVPlan:
    """The KV cache an engine allocates: one pool of `blocks[0]` blocks, or on a hybrid model one per
    kind of layer (`kinds`, the global kind first; kvgen.cache.hybrid). Sizes only, no tensors."""

    block_size: int
    kv_dtype: str
    layer_bytes_per_token: int  # one layer's K and V of one token
    num_layers: int
    blocks: tuple[int, ...]  # per kind; one entry for a model whose layers are all alike
    kinds: tuple[LayerKind, ...] = ()  # () unless the model is hybrid
    kind_layer_bytes: tuple[int, ...] = ()  # per kind, one layer's K and V of one token (Gemma 4's differ)
    sharing_layers: int = 0  # layers reading an earlier layer's K/V, which hold none (Gemma 4)

    def layer_bytes_of(self, kind: int) -> int:
        return self.kind_layer_bytes[kind] if self.kind_layer_bytes else self.layer_bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V of one token (of the layers that hold K/V)."""
        if self.kinds:
            return sum(len(k.layers) * self.layer_bytes_of(i) for i, k in enumerate(self.kinds))
        return self.num_layers * self.layer_bytes_per_token

    @property
    def num_blocks(self) -> int:
        """Blocks of the global pool (a replica's admission view is sized by it: kvgen.replicas)."""
        return self.blocks[0]

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pools hold: of a hybrid model, those of its global layers' pool."""
        return self.blocks[0] * self.block_size

    def manager(self, enable_prefix_caching: bool, chunk: int) -> KVCacheManager | HybridKVManager:
        """The block tables over these pools (bookkeeping only); `chunk`: most tokens a step computes."""
        if not self.kinds:
            return KVCacheManager(self.blocks[0], self.block_size, enable_prefix_caching)
        return HybridKVManager([KVCacheManager(n, self.block_size, enable_prefix_caching) for n in self.blocks],
                               list(self.kinds), chunk)

    def report(self) -> str:
        """One line of what the pools hold, for the start-up log."""
        if self.kinds:
            shared = f"; {self.sharing_layers} layers read an earlier layer's K/V (no blocks)" \
                if self.sharing_layers else ""
            return "hybrid KV cache: " + "; ".join(self._kind_report(i, n) for i, n in enumerate(self.blocks)) + shared
        return (f"KV cache: {self.blocks[0]} blocks x {self.block_size} tokens = {self.capacity_tokens} "
                f"tokens, {format_bytes(self.capacity_tokens * self.bytes_per_token)} "
                f"({self.bytes_per_token} bytes/token, {self.kv_dtype})")

    def _kind_report(self, index: int, num_blocks: int) -> str:
        kind = self.kinds[index]
        per_token = len(kind.layers) * self.layer_bytes_of(index)
        tokens = num_blocks * self.block_size
        what = "global" if kind.window is None else f"window {kind.window}"
        return (f"{len(kind.layers)} {what} layers, {num_blocks} blocks x {self.block_size} = {tokens} tokens, "
                f"{format_bytes(tokens * per_token)} ({per_token} bytes/token, {self.kv_dtype})")


def plan_kv(model: ModelConfig, config: EngineConfig, max_model_len: int) -> KVPlan:
    """Blocks per pool: `num_kv_blocks` each, else the budget (`kv_cache_memory`, or enough for
    `max_num_seqs` sequences of `max_model_len` tokens up to DEFAULT_KV_MEMORY) in whole blocks. A
    hybrid model's budget is split between its kinds in proportion to what a full-length sequence
    holds in each (kvgen.cache.hybrid.split_budget), so that they run out together. Layers that
    read an earlier layer's K/V (Gemma 4) hold none: only the holders count."""
    per_layer = kv_bytes_per_token_of(1, model.num_kv_heads, model.head_dim, config.kv_dtype)
    holders = model.kv_holders  # recurrent layers keep a state instead (kvgen.cache.state_pool)
    kinds = layer_kinds([model.window(i) for i in range(model.num_layers)], holders) if model.is_hybrid else []
    kind_bytes = [kind_layer_bytes(model, k, config.kv_dtype) for k in kinds]
    needs = (sequence_bytes(kinds, kind_bytes, max_model_len, config.max_num_batched_tokens, config.block_size)
             if kinds else [len(holders) * per_layer * max_model_len])
    budget = config.kv_cache_memory
    if budget is None:
        budget = min(config.max_num_seqs * sum(needs), DEFAULT_KV_MEMORY)
    if config.num_kv_blocks is not None:
        blocks = [config.num_kv_blocks] * len(needs)
    elif kinds:
        blocks = [num_blocks_for_budget(share, config.block_size, b * len(k.layers))
                  for share, k, b in zip(split_budget(budget, needs), kinds, kind_bytes)]
    else:
        blocks = [num_blocks_for_budget(budget, config.block_size, len(holders) * per_layer)]
    if min(blocks) < 1:
        raise ValueError(f"the KV budget holds no block of {config.block_size} tokens in every kind of layer"
                         if kinds else f"the KV budget holds no block of {config.block_size} tokens "
                         f"({len(holders) * per_layer} bytes per token)")
    return KVPlan(config.block_size, config.kv_dtype, per_layer, len(holders), tuple(blocks), tuple(kinds),
                  tuple(kind_bytes) if kind_bytes != [per_layer] * len(kinds) else (), model.num_layers - len(holders))


def kind_layer_bytes(model: ModelConfig, kind: LayerKind, kv_dtype: str) -> int:
    """One layer of `kind`'s K and V bytes per token; ValueError where its layers' shapes differ."""
    shapes = {(model.kv_heads_of(i), model.head_dim_of(i)) for i in kind.layers}
    if len(shapes) != 1:
        raise ValueError(f"layers {kind.layers} share a pool but not a shape (KV heads, head size): {sorted(shapes)}")
    heads, dim = shapes.pop()
    return kv_bytes_per_token_of(1, heads, dim, kv_dtype)
