"""int8 / int4 quantization of float weights: each weight within a step's half of its original."""

import numpy as np
import pytest
import torch

from kvgen.model.formats.float_weights import quantize_int4, quantize_int8
from kvgen.model.formats.packed import dequantize, untile

FP16_ULP = 2.0 ** -11  # fp16's relative rounding (11-bit significand)


def weights(scale: float) -> torch.Tensor:
    return torch.randn(9, 128, generator=torch.Generator().manual_seed(0)) * scale


@pytest.mark.parametrize("scale, stored", [(0.05, torch.float16), (1e-7, torch.float32)])
def test_int8_is_within_half_a_step(scale, stored):
    """Scales are fp16 unless some would be an fp16 subnormal (weights of 1e-7 would be)."""
    w = weights(scale)
    packed = quantize_int8(w)
    assert packed.scale.dtype == stored and packed.min is None and packed.bits == 8
    step = untile(packed.scale, packed).float().repeat_interleave(32, dim=1)
    # q = rint(w / s) is within 1/2 of w / s; s * q rounds once more in fp32
    assert ((dequantize(packed) - w).abs() <= step * (0.5 + 1e-6) + 1e-6 * w.abs()).all()


@pytest.mark.parametrize("scale, stored", [(0.05, torch.float16), (1e-7, torch.float32)])
def test_int4_is_within_half_a_step(scale, stored):
    """w^ = s q + m with m = the group's min and s = range / 15, both rounded to their storage first:
    q's rounding gives s/2, m's rounding up to FP16_ULP |m|, and s's rounding can push the top of
    the range past q = 15 (clipped) by 15 s FP16_ULP."""
    w = weights(scale)
    packed = quantize_int4(w)
    assert packed.scale.dtype == stored and packed.bits == 4
    step = untile(packed.scale, packed).float().repeat_interleave(32, dim=1)
    low = untile(packed.min, packed).float().repeat_interleave(32, dim=1)
    ulp = FP16_ULP if stored == torch.float16 else 2.0 ** -24
    bound = step * (0.5 + 15 * ulp) + ulp * low.abs() + 1e-6 * w.abs()
    assert ((dequantize(packed) - w).abs() <= bound).all()


def test_groups_with_no_range_are_exact():
    """int4 keeps a constant group as its min (scale 0); int8 keeps an all-zero group (scale 0)."""
    w = torch.full((4, 64), 0.25)
    w[1] = 0.0
    assert torch.equal(dequantize(quantize_int4(w)), w)
    assert torch.equal(dequantize(quantize_int8(torch.zeros(4, 64))), torch.zeros(4, 64))


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_int8(torch.randn(4, 40))
    assert np.all(np.isfinite(dequantize(quantize_int4(torch.randn(4, 32))).numpy()))
