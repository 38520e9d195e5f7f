"""KV-cache memory arithmetic: bytes per token, parsing and printing sizes, blocks per budget.

Size units (case-insensitive, optional "B", optional space):
  binary   Ki Mi Gi Ti Pi  (KiB, MiB, ...) = 1024^k
  decimal  K  M  G  T  P   (KB,  MB,  ...) = 1000^k   -- SI, as disks and `format_bytes` use
So "2GiB" = 2 * 1024**3 and "1.5G" = 1_500_000_000.
"""

from __future__ import annotations

import re
from fractions import Fraction

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
