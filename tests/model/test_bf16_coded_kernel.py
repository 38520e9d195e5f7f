"""The coded bf16 layout and kernel (kvgen/model/kernels/bf16_coded.c): lossless, and the bf16
kernel's sums.

Bound: as for the bf16 kernel (tests/model/test_bf16_kernel.py), a sum of K exact fp32 products in
some order errs by at most gamma(K) * sum |x w|, and one rounding to bf16 adds half a bf16 ulp. An
outlier's product is one of those K products, added after the rest: the bound does not change.
Where a tile has no outlier, the kernel adds the same products in the same order as the bf16 kernel,
so the bits are equal.
"""

import pytest
import torch

from kvgen.model import linear
from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel
from kvgen.model.kernels.bf16 import pack as pack_tiles
from kvgen.model.kernels.coded import coded_bf16_kernel
from kvgen.model.kernels.coded import pack_bf16 as pack
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.linear import DECODED_FROM_ROWS, ONEDNN_FROM_ROWS, Bf16Linear, CodedBf16Linear
from kvgen.model.linear_choice import make_linear
from tests.model.test_bf16_kernel import reference_and_bound

pytestmark = pytest.mark.skipif(coded_bf16_kernel() is None, reason="this CPU has no AVX-512 BF16")


def wide_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [n, k] over ~40 binades, zeros and signed zeros: many high bytes fall outside any table
    of 16, so every tile has outliers."""
    torch.manual_seed(seed)
    w = torch.randn(n, k) * torch.exp2(torch.randint(-30, 10, (n, k)).float())
    w[torch.rand(n, k) < 0.02] = 0.0
    w[torch.rand(n, k) < 0.02] = -0.0
    return w.bfloat16()


def narrow_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [n, k] with magnitudes in [1/4, 4): 6 high bytes, no outlier."""
    torch.manual_seed(seed)
    sign = torch.randint(0, 2, (n, k)).float() * 2 - 1
    return (sign * torch.exp2(torch.rand(n, k) * 4 - 2)).bfloat16()


@pytest.mark.parametrize("shape", [(4, 64), (101, 128), (576, 1536)])
def test_the_layout_keeps_every_bit(shape):
    w = wide_weight(*shape, seed=shape[0])
    packed = pack(w)
    assert packed.outliers.at.numel() > w.numel() // 10  # the wide weight really has outliers
    kernel = coded_bf16_kernel()
    assert torch.equal(kernel.unpack(packed, *shape, Bf16Tiles()).view(torch.int16), w.view(torch.int16))
    assert torch.equal(kernel.decode_tiles(packed, Bf16Tiles()), pack_tiles(w))
    assert packed.codes.numel() == -(-shape[0] // 4) * 4 * shape[1] * 3 // 2  # 12 bits a weight


@pytest.mark.parametrize("shape", [(96, 64), (101, 128), (3, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_matches_the_float64_matmul_within_its_rounding(shape, rows):
    w = wide_weight(*shape, seed=rows)
    x = torch.randn(rows, shape[1]).bfloat16()
    y = coded_bf16_kernel()(x, pack(w), shape[0])
    exact, bound = reference_and_bound(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_without_outliers_the_bits_are_the_bf16_kernels(rows, out_dtype):
    w, x = narrow_weight(103, 192, seed=rows), torch.randn(rows, 192).bfloat16()
    packed = pack(w)
    assert packed.outliers.at.numel() == 0
    assert torch.equal(coded_bf16_kernel()(x, packed, 103, out_dtype), bf16_kernel()(x, pack_tiles(w), 103, out_dtype))


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it():
    w, x = wide_weight(101, 128, seed=3), torch.randn(9, 128).bfloat16()
    packed = pack(w)
    batched = coded_bf16_kernel()(x, packed, 101)
    for r in range(9):
        assert torch.equal(coded_bf16_kernel()(x[r : r + 1].contiguous(), packed, 101)[0], batched[r])


def test_bf16_layers_whose_rows_are_whole_spans_take_the_coded_kernel():
    assert isinstance(make_linear(torch.randn(8, 128).bfloat16()), CodedBf16Linear)
    uncoded = make_linear(torch.randn(8, 96).bfloat16())
    assert isinstance(uncoded, Bf16Linear) and not isinstance(uncoded, CodedBf16Linear)
    layer = make_linear(narrow_weight(64, 128, seed=4))
    assert layer.weight_bytes == 64 * 128 * 3 // 2 + 16 + 8 * (64 // 4 + 1)  # tiles, table, tile starts


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("rows", [DECODED_FROM_ROWS - 1, DECODED_FROM_ROWS, ONEDNN_FROM_ROWS + 3])
def test_a_coded_layer_gives_the_bf16_layers_bits_on_its_bf16_paths(rows, monkeypatch):
    """Below DECODED_FROM_ROWS the coded kernel (the bf16 kernel's bits: no outlier here); from there
    the bf16 kernel on decoded tiles, from ONEDNN_FROM_ROWS oneDNN on the decoded row-major weight."""
    monkeypatch.setattr(linear, "fp32_beats", lambda rival: False)
    w, b = narrow_weight(101, 128, seed=5), torch.randn(101).bfloat16()
    coded, plain = make_linear(w, b, Bf16Tiles()), Bf16Linear(w, b, bf16_kernel(), Bf16Tiles())
    assert isinstance(coded, CodedBf16Linear)
    expected = "coded" if rows < DECODED_FROM_ROWS else "tiles" if rows < ONEDNN_FROM_ROWS else "onednn"
    assert coded.path(rows) == expected
    x = torch.randn(rows, 128).bfloat16()
    assert torch.equal(coded(x), plain(x))


@pytest.mark.skipif(f32_kernel() is None, reason="no fp32 kernel here")
@pytest.mark.parametrize("rows", [DECODED_FROM_ROWS, ONEDNN_FROM_ROWS + 3])
def test_where_fp32_is_faster_many_rows_run_on_decoded_fp32_panels(rows, monkeypatch):
    """Products of bf16 values are exact in fp32 and summed in one fp32 chain, then rounded to bf16
    once: the bf16 kernel's bound (outliers included)."""
    monkeypatch.setattr(linear, "fp32_beats", lambda rival: True)
    w = wide_weight(37, 64, seed=9)
    layer = make_linear(w, None, Bf16Tiles())
    assert layer.path(rows) == "fp32"
    x = torch.randn(rows, 64).bfloat16()
    exact, bound = reference_and_bound(x, w)
    assert ((layer(x).double() - exact).abs() <= bound).all()


def test_outliers_survive_every_path_of_a_layer():
    w = wide_weight(37, 64, seed=6)
    layer = make_linear(w, None, Bf16Tiles())
    for rows in (1, DECODED_FROM_ROWS, ONEDNN_FROM_ROWS):
        x = torch.randn(rows, 64).bfloat16()
        exact, bound = reference_and_bound(x, w)
        assert ((layer(x).double() - exact).abs() <= bound).all()
