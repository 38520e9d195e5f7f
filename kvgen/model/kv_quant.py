"""Quantized KV pools: int8 and fp8 (e4m3) values with one float32 scale per (token, KV head).

    int8   symmetric: q = round(x / s), s = max|x| / 127, so |x - q s| <= s / 2
    fp8    e4m3fn: q = fp8(x / s), s = max|x| / 448 (e4m3's largest finite value): the row's largest
           element lands on 448 and none saturates, whatever the outliers; 3 mantissa bits keep the
           relative error of each element within 2**-4

A scale per (token, head) rather than per tensor keeps one outlier token from flattening the others.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype name -> the pools' element type
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "int8": torch.int8, "fp8": torch.float8_e4m3fn}
# largest magnitude a quantized element holds
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] of `dtype`, scales [...] float32), one scale per row."""
    x = x.float()
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
    """values [..., D], scales [...] -> [..., D] of `dtype` (the model's compute dtype)."""
    return (values.float() * scales[..., None]).to(dtype)
