"""The RMSNorm kernel (kvgen/model/kernels/rms_norm.c) against a float64 reference and torch's op.

fp32 bound: the sum of n squares errs by at most gamma(n + 1) relative (tests/support/tolerances.py), which
the square root halves; the mean, + eps, the square root, the reciprocal and the two products add one
rounding each (u = 2^-24 relative): |y - exact| <= (gamma(n + 1) / 2 + 6u) |exact|.
"""

import pytest
import torch

from kvgen.model.kernels.norm import rms_norm_kernel
from kvgen.model.layers import make_rms_norm, rms_norm
from tests.support.tolerances import FP32_UNIT_ROUNDOFF, gamma

EPS = 1e-5
BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: one step is at most 2^-7 of the value

pytestmark = pytest.mark.skipif(rms_norm_kernel() is None, reason="no C compiler for the kernel")


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return w.double() * (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("rows, n", [(1, 576), (7, 64), (3, 33), (512, 2048)])
def test_fp32_matches_the_float64_norm_within_its_rounding(rows, n):
    torch.manual_seed(n)
    x, w = torch.randn(rows, n) * 3, torch.randn(n)
    y = rms_norm_kernel()(x, w, EPS)
    want = exact(x, w)
    bound = (gamma(n + 1) / 2 + 6 * FP32_UNIT_ROUNDOFF) * want.abs()
    assert y.dtype == torch.float32 and ((y.double() - want).abs() <= bound).all()


def test_bf16_rounds_as_hugging_face_does():
    """HF rounds x * r to bf16, then the product with the weight: the kernel lands on torch's value or,
    where its fp32 statistics differ in the last bits, at most one bf16 step away per rounding."""
    torch.manual_seed(0)
    x, w = torch.randn(9, 576).bfloat16(), torch.randn(576).bfloat16()
    got, want = rms_norm_kernel()(x, w, EPS), rms_norm(x, w, EPS)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= 2 * BF16_STEP * want.float().abs()).all()
    assert (got == want).float().mean() > 0.99


def test_cpu_models_take_the_kernel_at_every_row_count():
    cpu, w = torch.device("cpu"), torch.randn(64)
    norm = make_rms_norm(cpu, torch.float32)
    for rows in (1, 15, 16, 512):
        x = torch.randn(rows, 64)
        assert torch.equal(norm(x, w, EPS), rms_norm_kernel()(x, w, EPS))
    assert make_rms_norm(cpu, torch.float16) is rms_norm


def test_mismatched_operands_are_refused():
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm_kernel()(torch.randn(2, 8), torch.randn(8).bfloat16(), EPS)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm_kernel()(torch.randn(2, 8), torch.randn(9), EPS)
