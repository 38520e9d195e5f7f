"""The bf16 matmul kernel (kvgen/model/kernels/bf16_matmul.c) against a float64 reference.

Bound: a product of two bf16 values is exact in fp32, so the kernel's fp32 sum of K products errs by
at most gamma(K) * sum |x w| (tests/support/tolerances.py), and rounding that sum once to bf16 adds at most
half a bf16 ulp, 2^-8 |y| (bf16 keeps 8 significant bits). vdpbf16ps flushes denormal inputs to zero;
the inputs here are normal.
"""

import pytest
import torch

from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel, pack
from kvgen.model.linear import ONEDNN_FROM_ROWS, Bf16Linear
from kvgen.model.linear_choice import make_linear
from tests.support.tolerances import gamma

BF16_UNIT_ROUNDOFF = 2.0**-8

pytestmark = pytest.mark.skipif(bf16_kernel() is None, reason="this CPU has no AVX-512 BF16")


def reference_and_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    return exact, gamma(x.shape[1]) * magnitude * (1 + BF16_UNIT_ROUNDOFF) + BF16_UNIT_ROUNDOFF * exact.abs()


@pytest.mark.parametrize("shape", [(96, 64), (101, 70), (3, 33), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_matches_the_float64_matmul_within_its_rounding(shape, rows):
    torch.manual_seed(rows)
    w, x = torch.randn(shape).bfloat16(), torch.randn(rows, shape[1]).bfloat16()
    y = bf16_kernel()(x, pack(w), shape[0])
    exact, bound = reference_and_bound(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound).all()


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it():
    torch.manual_seed(0)
    w, x = torch.randn(101, 70).bfloat16(), torch.randn(9, 70).bfloat16()
    packed = pack(w)
    batched = bf16_kernel()(x, packed, 101)
    for r in range(9):
        assert torch.equal(bf16_kernel()(x[r : r + 1].contiguous(), packed, 101)[0], batched[r])


def test_bf16_on_this_cpu_takes_the_kernel_with_its_bias():
    torch.manual_seed(1)
    w, b, x = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16(), torch.randn(3, 64).bfloat16()
    linear = make_linear(w, b)
    assert isinstance(linear, Bf16Linear)
    exact, bound = reference_and_bound(x, w)
    # the bias is added in bf16 after the product's rounding: one more bf16 rounding of the sum
    total = exact + b.double()
    assert ((linear(x).double() - total).abs() <= 2 * bound + BF16_UNIT_ROUNDOFF * total.abs() + 1e-30).all()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 here")
def test_many_rows_run_onednn_on_the_unpacked_weight_within_the_same_bound():
    """From ONEDNN_FROM_ROWS rows (prefill) a layer given the model's scratch buffer unpacks its
    tiles to row-major and runs oneDNN's GEMM: fp32 sums of exact products too, so the same bound."""
    torch.manual_seed(2)
    w, b = torch.randn(101, 70).bfloat16(), torch.randn(101).bfloat16()
    assert torch.equal(bf16_kernel().unpack(pack(w), 101, 70, Bf16Tiles()), w)
    linear, kernel_only = make_linear(w, b, Bf16Tiles()), make_linear(w, b)
    x = torch.randn(ONEDNN_FROM_ROWS + 3, 70).bfloat16()
    exact, bound = reference_and_bound(x, w)
    total = exact + b.double()
    assert ((linear(x).double() - total).abs() <= 2 * bound + BF16_UNIT_ROUNDOFF * total.abs() + 1e-30).all()
    assert torch.equal(linear(x[:5]), kernel_only(x[:5]))  # fewer rows: the kernel, as without scratch


def test_x_that_does_not_fit_the_weight_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        bf16_kernel()(torch.randn(1, 96).bfloat16(), pack(torch.randn(8, 64).bfloat16()), 8)
    with pytest.raises(ValueError, match="contiguous bf16"):
        bf16_kernel()(torch.randn(1, 64), pack(torch.randn(8, 64).bfloat16()), 8)
