"""The fp32 matmul kernel (kvgen/model/kernels/f32_matmul.c) against a float64 reference.

Bound: a product of two fp32 values rounds once (or not at all, fused into the FMA), and the kernel's
fp32 sum of K products errs by at most gamma(K) * sum |x w| in all (tests/tolerances.py: gamma(K)
covers the K - 1 additions and the rounding of each product).
"""

import pytest
import torch

from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.linear import F32Linear, make_linear
from tests.tolerances import gamma

pytestmark = pytest.mark.skipif(f32_kernel() is None, reason="this CPU has no AVX-512")


def reference_and_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exact = x.double() @ w.double().T
    return exact, gamma(x.shape[1] + 1) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("shape", [(96, 64), (101, 70), (3, 17), (5, 15), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 15, 17, 64])
def test_matches_the_float64_matmul_within_its_rounding(shape, rows):
    torch.manual_seed(rows)
    w, x = torch.randn(shape), torch.randn(rows, shape[1])
    y = f32_kernel()(x, w)
    exact, bound = reference_and_bound(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it():
    """What speculation's exactness and `none` == `contiguous` rest on: a decode row alone, in a
    verify chunk, or in a prefill of hundreds of rows comes out the same."""
    torch.manual_seed(0)
    w, x = torch.randn(101, 70), torch.randn(300, 70)
    batched = f32_kernel()(x, w)
    for r in (0, 1, 5, 8, 299):
        assert torch.equal(f32_kernel()(x[r : r + 1].contiguous(), w)[0], batched[r])
    for first, last in ((3, 12), (3, 18)):  # one row pass of 9, of 15
        assert torch.equal(f32_kernel()(x[first:last].contiguous(), w), batched[first:last])


def test_fp32_on_this_cpu_takes_the_kernel_with_its_bias():
    torch.manual_seed(1)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(3, 64)
    linear = make_linear(w, b)
    assert isinstance(linear, F32Linear)
    exact, bound = reference_and_bound(x, w)
    total = exact + b.double()  # the bias adds one more fp32 rounding of the sum
    assert ((linear(x).double() - total).abs() <= bound + gamma(1) * total.abs() * 2).all()


def test_bad_operands_are_refused():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"weight must be contiguous fp32 \[N, 96\]"):
        f32_kernel()(torch.randn(1, 96), w)
    with pytest.raises(ValueError, match="contiguous fp32"):
        f32_kernel()(torch.randn(1, 64).bfloat16(), w)
