"""Error bounds of the quantized kernel, derived from its roundings.

The kernel quantizes each row of x per span of 32 to x^ = s_x * q (q = round(x / s_x),
s_x = max|x| / 127); with activations "int8x2" a second part quantizes the rounding error
r = fl(x - fl(s_x q)) the same way, x^ = s_1 q_1 + s_2 q_2, and the parts' results are added. Each
part's dot products with the dequantized weights W^ are exact in int32, rounding only in fp32 scale
products and sums. Two bounds follow, both against float64 references:
    y - x^ W^T :  (K / 32 + 25) * 2^-24 * sum_parts sum_i (|s (u_i - o)| + |m|) |x^_part,i|
                  (fp32 accumulation: a chain of K/32 span FMAs plus the lane and min reductions and
                  the parts' sum, over the magnitudes of the two terms each weight is split into)
    y - x W^T  :  that, plus sum_i e_i |w^_i| with e_i = s_last (1/2 + 4 * 127 * 2^-24)
                  (+ 2^-23 (|x_i| + s_1) for the residual's two roundings with two parts):
                  q is rounded from fl(x * fl(127 / max|x|)), within 4 * 127 ulps of x / s_x
"""

import torch

from kvgen.model.formats.packed import PackedWeight, dequantize, unpack_codes, untile
from kvgen.model.kernels.qmatmul import qmatmul_kernel

U = 2.0 ** -24


def term_magnitudes(w: PackedWeight) -> torch.Tensor:
    """|s (u - o)| + |m| per weight, float64 [out, in]."""
    out, cols = w.shape
    q = (unpack_codes(w).double() - w.offset).reshape(out, cols // w.group, w.group)
    scaled = (q * untile(w.scale, w).double()[..., None]).abs()
    if w.min is not None:
        scaled = scaled + untile(w.min, w).double().abs()[..., None]
    return scaled.reshape(out, cols)


def quantized_x(x: torch.Tensor, activations: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^ of each part float64 [parts, T, K], each part's s_x repeated over its span [parts, T, K])"""
    q, scale = qmatmul_kernel().quantize_activations(x, activations)
    spans = scale.double().repeat_interleave(32, dim=2)
    return q.double() * spans, spans


def bounds(w: PackedWeight, x: torch.Tensor, activations: str = "int8"):
    """(x^ float64 [T, K], bound on |y - x^ W^T|, bound on |y - x W^T|), both [T, out]."""
    parts, s_x = quantized_x(x, activations)
    magnitudes = term_magnitudes(w).T
    accumulation = (x.shape[1] / 32 + 25) * U * sum(part.abs() @ magnitudes for part in parts)
    step = s_x[-1] * (0.5 + 4 * 127 * U)
    if len(parts) == 2:
        step = step + 2 * U * (x.double().abs() + s_x[0])
    activation = step @ dequantize(w).double().abs().T
    return parts.sum(0), accumulation, accumulation + activation


def check_kernel_output(y: torch.Tensor, w: PackedWeight, x: torch.Tensor, activations: str = "int8") -> None:
    """y: the kernel's output for x [T, K] and w; asserts both bounds."""
    y, w_hat = y.double(), dequantize(w).double()
    x_hat, to_x_hat, to_x = bounds(w, x, activations)
    assert ((y - x_hat @ w_hat.T).abs() <= to_x_hat).all()
    assert ((y - x.double() @ w_hat.T).abs() <= to_x).all()
