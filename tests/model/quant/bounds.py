"""Error bounds of the VNNI kernel, derived from its roundings.

The kernel quantizes each row of x per span of 32 to x^ = s_x * q (q = round(x / s_x),
s_x = max|x| / 127) and then computes the dot products of x^ with the dequantized weights W^
exactly in int32, rounding only in fp32 scale products and sums. Two bounds follow, both against
float64 references:
    y - x^ W^T :  (K / 32 + 24) * 2^-24 * sum_i (|s (u_i - o)| + |m|) |x^_i|   (fp32 accumulation:
                  a chain of K/32 span FMAs plus the lane and min reductions, over the magnitudes
                  of the two terms each weight is split into)
    y - x W^T  :  that, plus sum_span s_x (1/2 + 4 * 127 * 2^-24) * sum_{i in span} |w^_i|
                  (activation rounding: q is rounded from fl(x * fl(127 / max|x|)), which is within
                  4 * 127 ulps of x / s_x)
"""

import torch

from kvgen.model.quant.formats import PackedWeight, dequantize, unpack_codes, untile
from kvgen.model.quant.kernel import vnni_kernel

U = 2.0 ** -24


def term_magnitudes(w: PackedWeight) -> torch.Tensor:
    """|s (u - o)| + |m| per weight, float64 [out, in]."""
    out, cols = w.shape
    q = (unpack_codes(w).double() - w.offset).reshape(out, cols // w.group, w.group)
    scaled = (q * untile(w.scale, w).double()[..., None]).abs()
    if w.min is not None:
        scaled = scaled + untile(w.min, w).double().abs()[..., None]
    return scaled.reshape(out, cols)


def quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^ float64 [T, K], s_x repeated over each span float64 [T, K])"""
    q, scale = vnni_kernel().quantize_activations(x)
    spans = scale.double().repeat_interleave(32, dim=1)
    return q.double() * spans, spans


def bounds(w: PackedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x^ float64 [T, K], bound on |y - x^ W^T|, bound on |y - x W^T|), both [T, out]."""
    x_hat, s_x = quantized_x(x)
    accumulation = (x.shape[1] / 32 + 24) * U * (x_hat.abs() @ term_magnitudes(w).T)
    activation = (s_x * (0.5 + 4 * 127 * U)) @ dequantize(w).double().abs().T  # sum over spans of s_x/2 sum|w|
    return x_hat, accumulation, accumulation + activation


def check_kernel_output(y: torch.Tensor, w: PackedWeight, x: torch.Tensor) -> None:
    """y: the kernel's output for x [T, K] and w; asserts both bounds."""
    y, w_hat = y.double(), dequantize(w).double()
    x_hat, to_x_hat, to_x = bounds(w, x)
    assert ((y - x_hat @ w_hat.T).abs() <= to_x_hat).all()
    assert ((y - x.double() @ w_hat.T).abs() <= to_x).all()
