"""Quantized KV pools: int8 and fp8 (e4m3) values with float32 scales: a key has one per KEY_GROUP
dimensions (per (token, KV head, group of 16)), a value one per (token, KV head).

    int8   symmetric: q = round(x / s), s = max|x| / 127, so |x - q s| <= s / 2
    fp8    e4m3fn: q = fp8(x / s), s = max|x| / 448 (e4m3's largest finite value): the row's largest
           element lands on 448 and none saturates, whatever the outliers; 3 mantissa bits keep the
           relative error of each element within 2**-4

A scale per (token, head) rather than per tensor keeps one outlier token from flattening the others.
Keys have outlier channels as well (a few RoPE dimensions run 10-50x the rest, KIVI's observation):
under one scale per row they flatten the other channels of the same key, so keys get a scale per
group of KEY_GROUP dimensions (docs/kv-cache.md measures what that buys on SmolLM2). Scales are
fixed when a row is written, so the paged cache's write-once blocks, copy-on-write and prefix
sharing are unchanged; a key row of 64 dimensions carries 16 bytes of scales instead of 4.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype name -> the pools' element type
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "int8": torch.int8, "fp8": torch.float8_e4m3fn}
# largest magnitude a quantized element holds
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# Dimensions per key scale. A multiple of 16, so that the decode kernel's 16-lane loads each meet
# one scale; head sizes it does not divide get one scale per key row.
KEY_GROUP = 16


def key_groups(head_dim: int) -> int:
    """Scales per key row: head_dim / KEY_GROUP where it divides, else 1."""
    return head_dim // KEY_GROUP if head_dim % KEY_GROUP == 0 else 1


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def quantize(x: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] of `dtype`, scales float32): one scale per row ([...]) with
    groups=1, else one per D / groups consecutive elements ([..., groups])."""
    x = x.float()
    if groups > 1:
        values, scales = quantize(x.unflatten(-1, (groups, -1)), dtype)
        return values.flatten(-2), scales
    scales = x.abs().amax(dim=-1) / QUANT_MAX[dtype]
    scaled = x / torch.where(scales > 0, scales, 1.0)[..., None]  # an all-zero row stays zero
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scales
    return scaled.to(dtype), scales


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as its bytes (torch's CPU index_copy / index_select do not take fp8), any
    other as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D], scales [...] (one per row) or [..., G] (one per D / G elements, when
    scales has one more dimension than a row's index) -> [..., D] of `dtype` (the compute dtype)."""
    if scales.dim() == values.dim():
        grouped = values.unflatten(-1, (scales.shape[-1], -1)).float() * scales[..., None]
        return grouped.flatten(-2).to(dtype)
    return (values.float() * scales[..., None]).to(dtype)
