"""The coded fp32 layout and kernel (kvgen/model/kernels/f32_coded.c): lossless, and the fp32
kernel's chains.

Bound: as for the fp32 kernel (tests/model/test_f32_kernel.py), gamma(K + 1) * sum |x w|, in
whatever order the products are summed: an outlier's product is one of them, added after the chain.
Where a panel has no outlier, each output is the fp32 kernel's chain of multiply-adds (a weight
stored as +0 adds nothing), so the bits are equal.
"""

import pytest
import torch

from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.f32 import pack as pack_panels
from kvgen.model.kernels.coded import STEP_BYTES, coded_f32_kernel
from kvgen.model.kernels.coded import pack_f32 as pack
from kvgen.model.linear import CodedF32Linear
from kvgen.model.linear_choice import make_linear
from tests.model.test_f32_kernel import reference_and_bound

pytestmark = pytest.mark.skipif(coded_f32_kernel() is None, reason="this CPU has no AVX-512 VBMI")


def wide_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """fp32 [n, k] over ~40 binades, zeros and signed zeros: every panel has outliers."""
    torch.manual_seed(seed)
    w = torch.randn(n, k) * torch.exp2(torch.randint(-30, 10, (n, k)).float())
    w[torch.rand(n, k) < 0.02] = 0.0
    w[torch.rand(n, k) < 0.02] = -0.0
    return w


def narrow_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """fp32 [n, k] with magnitudes in [1/4, 4): 6 top bytes, no outlier."""
    torch.manual_seed(seed)
    sign = torch.randint(0, 2, (n, k)).float() * 2 - 1
    return sign * torch.exp2(torch.rand(n, k) * 4 - 2)


def coded_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return coded_f32_kernel()(x, pack(w), w.shape[0])


@pytest.mark.parametrize("shape", [(5, 15), (101, 70), (64, 576)])
def test_the_layout_keeps_every_bit(shape):
    w = wide_weight(*shape, seed=shape[0])
    packed = pack(w)
    assert packed.outliers.at.numel() > w.numel() // 10  # the wide weight really has outliers
    assert packed.codes.shape == (-(-shape[0] // 32), shape[1], STEP_BYTES)  # 28 bits a weight
    rows = coded_f32_kernel().rows(packed, torch.arange(shape[0]))
    assert torch.equal(rows.view(torch.int32), w.view(torch.int32))


@pytest.mark.parametrize("shape", [(96, 64), (101, 70), (5, 15), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 14, 15, 29, 64])
def test_matches_the_float64_matmul_within_its_rounding(shape, rows):
    """Up to 14 rows one pass decodes in registers; from 15 it also keeps the decoded panel for the rest."""
    w, x = wide_weight(*shape, seed=rows), torch.randn(rows, shape[1])
    y = coded_matmul(x, w)
    exact, bound = reference_and_bound(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 14, 15, 30])
def test_without_outliers_the_bits_are_the_fp32_kernels(rows):
    w, x = narrow_weight(101, 70, seed=rows), torch.randn(rows, 70)
    packed = pack(w)
    assert packed.outliers.at.numel() == 0
    assert torch.equal(coded_f32_kernel()(x, packed, 101), f32_kernel()(x, pack_panels(w), 101))


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it():
    """Outliers included, and across the two paths (one pass up to 14 rows, a decoded panel after)."""
    w, x = wide_weight(101, 70, seed=7), torch.randn(300, 70)
    packed = pack(w)
    batched = coded_f32_kernel()(x, packed, 101)
    for r in (0, 1, 5, 299):
        assert torch.equal(coded_f32_kernel()(x[r : r + 1].contiguous(), packed, 101)[0], batched[r])
    for first, last in ((3, 7), (3, 17), (3, 18)):  # 4 rows, 14, passes of 14 + 1
        assert torch.equal(coded_f32_kernel()(x[first:last].contiguous(), packed, 101), batched[first:last])


def test_fp32_layers_take_the_coded_kernel_and_count_its_bytes():
    layer = make_linear(narrow_weight(64, 128, seed=8), torch.zeros(64))
    assert isinstance(layer, CodedF32Linear)
    assert layer.weight_bytes == 2 * 128 * STEP_BYTES + 16 + 8 * 3  # panels, table, panel starts
    ids = torch.tensor([0, 63, 31, 31])
    assert torch.equal(layer.weight_rows(ids), narrow_weight(64, 128, seed=8)[ids])
