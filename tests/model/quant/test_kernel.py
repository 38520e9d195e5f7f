"""The quantized kernel (either build) against the dequantized matmul, for every mapped GGUF type
and the float quantizers, at 1 row (decode) and many (prefill), on one thread and two; bounds.py
derives the tolerances."""

import pytest
import torch

from kvgen.model.formats.float_weights import quantize_int4, quantize_int8
from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel
from kvgen.model.formats.packed import PackedWeight, dequantize
from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.kernels.qmatmul import BUILDS, qmatmul_build, qmatmul_kernel
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.f32 import pack as pack_f32
from kvgen.model.kernels.many_rows_choice import INTEGER_BELOW_ROWS, INTEGER_ROWS, PREFILL_ROWS, many_rows_dtype
from kvgen.model import linear, quant_linear
from kvgen.model.linear import ONEDNN_FROM_ROWS
from kvgen.model.quant_linear import BF16_FROM_ROWS, FP32_FROM_ROWS, KernelQuantLinear, ManyRows
from tests.support.tolerances import gamma
from tests.model.quant.bounds import check_kernel_output
from tests.model.quant.raw_blocks import MAPPED, raw_matrix
from tests.support.torch_threads import torch_threads

pytestmark = pytest.mark.skipif(qmatmul_kernel() is None,
                                reason="CPU with neither AVX-512 VNNI nor AVX2: layers use torch")


def check(w: PackedWeight, x: torch.Tensor, activations: str = "int8") -> None:
    check_kernel_output(qmatmul_kernel().bind(w, activations)(x), w, x, activations)


def gguf_weight(ggml_type, out=12, cols=512) -> PackedWeight:
    return convert(ggml_type, raw_matrix(ggml_type, out, cols), (out, cols))


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_kernel_equals_dequantized_matmul(ggml_type, rows, activations):
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    check(gguf_weight(ggml_type), x, activations)


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_every_build_this_cpu_runs_gives_the_same_bits(ggml_type, activations):
    """qvec.h's two builds (AVX-512 VNNI, AVX2) run the same integer sums and fp32 steps in the same
    order: a CPU with both gets one answer from either, at 1, few and many rows."""
    builds = [kernel for kernel in (qmatmul_build(isa) for isa, _, _ in BUILDS) if kernel is not None]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs {len(builds)} of the builds ({', '.join(b.isa for b in builds) or 'none'})")
    w = gguf_weight(ggml_type, out=37)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(6))
    for rows in (1, 3, 13, 70):
        want = builds[0].bind(w, activations)(x[:rows])
        assert all(torch.equal(kernel.bind(w, activations)(x[:rows]), want) for kernel in builds[1:])


def test_two_parts_are_some_hundred_times_closer_to_x():
    """The second part's step is the first's rounding error / 127, so at most ~1/254 of the first."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    q, scale = qmatmul_kernel().quantize_activations(x, "int8x2")
    assert q.shape == (2, 3, 256) and scale.shape == (2, 3, 8)
    assert (scale[1] <= scale[0] * (0.5 + 1e-4) / 127).all()


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("magnitude, stored", [(0.05, torch.float16), (1e-7, torch.float32)])
def test_kernel_on_float_quantized_weights(quantize, rows, magnitude, stored):
    """96 columns are 3 groups, so the kernel's one chunk of groups is a tail (fewer than 4): the
    partial loads of fp16 and of fp32 scales."""
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(10, 96, generator=gen) * magnitude)
    assert w.scale.dtype == stored
    check(w, torch.randn(rows, 96, generator=gen) * 3)


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(activations):
    """Rows go four at a time, then two, then one, through the same operations."""
    w = gguf_weight(MAPPED[1])
    x = torch.randn(67, 512, generator=torch.Generator().manual_seed(1))
    kernel = qmatmul_kernel().bind(w, activations)
    all_rows = kernel(x)
    for rows in (1, 3, 5, 64):
        assert torch.equal(kernel(x[:rows].contiguous()), all_rows[:rows])


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("rows", [1, 64])
def test_two_threads_give_the_same_bits(rows, activations):
    """Each output is one thread's work (the suite otherwise runs on one thread). The weights are
    large enough for the kernel to use both threads (64 KiB of work) at 1 row and at 64."""
    gen = torch.Generator().manual_seed(2)
    w = quantize_int8(torch.randn(1024 if rows == 1 else 256, 1024, generator=gen))
    x = torch.randn(rows, 1024, generator=gen)
    kernel = qmatmul_kernel().bind(w, activations)
    one = kernel(x)
    with torch_threads(2):
        two = kernel(x)
    assert torch.equal(one, two)
    check(w, x, activations)


def test_zero_rows_and_all_zero_groups():
    w = quantize_int4(torch.zeros(4, 64))
    kernel = qmatmul_kernel().bind(w)
    assert kernel(torch.empty(0, 64)).shape == (0, 4)
    assert torch.equal(kernel(torch.zeros(2, 64)), torch.zeros(2, 4))


def test_x_of_the_wrong_shape_or_dtype_is_refused():
    kernel = qmatmul_kernel().bind(quantize_int8(torch.randn(4, 64)))
    with pytest.raises(ValueError, match=r"contiguous fp32 \[T, 64\]"):
        kernel(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float64"):
        kernel(torch.randn(2, 64, dtype=torch.float64))


# -- many rows: the weight dequantized to bf16 --------------------------------------------------------

BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_tiles_to_rows(tiles: torch.Tensor, out: int) -> torch.Tensor:
    """kvgen.model.kernels.bf16's layout [tiles, spans, 4, 32] -> [out, in]."""
    n_tiles, spans = tiles.shape[:2]
    return tiles.transpose(1, 2).reshape(n_tiles * 4, spans * 32)[:out]


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_dequantized_bf16_tiles_are_the_weights_rounded_to_bf16(ggml_type):
    """Each value is s * (u - o) + m from one fp32 FMA, then rounded to the nearest bf16: the exact
    dequantized value, rounded, or (where the FMA's rounding crosses a tie) its bf16 neighbour."""
    w = gguf_weight(ggml_type, out=13)
    got = bf16_tiles_to_rows(qmatmul_kernel().bind(w).dequantize_bf16(), 13).float()
    exact = dequantize(w)
    assert torch.equal(got, exact.bfloat16().float()) or (
        (got - exact).abs() <= BF16_UNIT_ROUNDOFF * exact.abs() * (1 + 2**-15)).all()
    assert (got == exact.bfloat16().float()).float().mean() > 0.999


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_dequantized_bf16_rows_are_the_tiles_values_row_major(ggml_type):
    bound = qmatmul_kernel().bind(gguf_weight(ggml_type, out=13))
    assert torch.equal(bound.dequantize_bf16_rows(), bf16_tiles_to_rows(bound.dequantize_bf16(), 13))


@pytest.mark.parametrize("ggml_type", MAPPED[:3], ids=lambda t: t.name)
def test_prefill_rows_run_on_onednn_where_it_measures_faster(ggml_type, monkeypatch):
    """Forced here (as if oneDNN measured faster), so that every host runs the path AMX hosts take:
    x and W^ rounded to bf16 (relative u = 2^-8), summed in fp32, the sums rounded to bf16:
    |y - x W^T| <= ((1 + u)^3 - 1 + gamma(K) (1 + u)^3) sum |x| |W^|; below ONEDNN_FROM_ROWS rows,
    the layer's own many-rows path as before."""
    if many_rows_dtype() is None or not linear.has_onednn_bf16():
        pytest.skip("this CPU runs neither float kernel, or oneDNN has no bf16 GEMM here")
    w = gguf_weight(ggml_type, out=13)
    own = KernelQuantLinear(w, None, "int8x2", ManyRows(Bf16Tiles()))
    monkeypatch.setattr(quant_linear, "onednn_beats", lambda rival: True)
    layer = KernelQuantLinear(w, None, "int8x2", ManyRows(Bf16Tiles()))
    x = torch.randn(ONEDNN_FROM_ROWS + 3, 512, generator=torch.Generator().manual_seed(4))
    dense = dequantize(w).double()
    u = BF16_UNIT_ROUNDOFF
    bound = ((1 + u) ** 3 - 1 + gamma(512) * (1 + u) ** 3) * (x.double().abs() @ dense.abs().T)
    assert ((layer(x).double() - x.double() @ dense.T).abs() <= bound).all()
    assert f"from {ONEDNN_FROM_ROWS} onednn" in layer.kernel
    assert torch.equal(layer(x[:ONEDNN_FROM_ROWS - 1]), own(x[:ONEDNN_FROM_ROWS - 1]))


@pytest.fixture
def float_path(monkeypatch):
    """The float path taken wherever its kernel runs, as on CPUs where it measures faster than the
    integer kernel (float_from_rows): its threshold is then the dtype's own."""
    monkeypatch.setattr(quant_linear, "integer_beats", lambda dtype, rows=INTEGER_ROWS, *_: False)


def test_float_path_starts_where_the_integer_kernel_stops_measuring_faster(monkeypatch):
    """None where the integer kernel wins at a prefill chunk's rows; else the dtype's threshold,
    raised to INTEGER_BELOW_ROWS where it wins at INTEGER_ROWS; none without a float kernel."""
    for at_prefill, at_64, want in ((True, True, None), (True, False, None), (False, True, INTEGER_BELOW_ROWS),
                                    (False, False, BF16_FROM_ROWS)):
        wins = {PREFILL_ROWS: at_prefill, INTEGER_ROWS: at_64}
        monkeypatch.setattr(quant_linear, "integer_beats", lambda dtype, rows=INTEGER_ROWS, *_: wins[rows])
        assert quant_linear.float_from_rows(torch.bfloat16, "avx512-vnni", 4, "int8x2") == want
    assert quant_linear.float_from_rows(None, "avx512-vnni", 4, "int8x2") is None


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_many_rows_stay_on_the_integer_kernel_where_it_measures_faster(activations, monkeypatch):
    """Then a prefill chunk's rows run as a decode's do, x quantized as the layer's activations say."""
    monkeypatch.setattr(quant_linear, "integer_beats", lambda dtype, rows=INTEGER_ROWS, *_: True)
    w = gguf_weight(MAPPED[0], out=13)
    layer = KernelQuantLinear(w, None, activations, ManyRows(Bf16Tiles(), onednn=False))
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5))
    assert torch.equal(layer(x), qmatmul_kernel().bind(w, activations)(x))
    assert "_matmul" not in layer.kernel


@pytest.mark.parametrize("extra", [0, 54])
@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_many_rows_run_in_bf16_within_its_rounding(ggml_type, extra, float_path):
    """x and W^ each rounded to bf16 (relative 2^-8), products exact in fp32, summed in fp32:
    |y - x W^T| <= ((1 + u)^2 - 1 + gamma(K) (1 + u)^2) sum |x| |W^|, u = 2^-8."""
    if bf16_kernel() is None:
        pytest.skip("this CPU has no AVX-512 BF16")
    w = gguf_weight(ggml_type, out=13)
    first = BF16_FROM_ROWS
    x = torch.randn(first + extra, 512, generator=torch.Generator().manual_seed(extra))
    layer = KernelQuantLinear(w, None, "int8x2", ManyRows(Bf16Tiles(), torch.bfloat16))
    dense = dequantize(w).double()
    u = BF16_UNIT_ROUNDOFF
    bound = ((1 + u) ** 2 - 1 + gamma(512) * (1 + u) ** 2) * (x.double().abs() @ dense.abs().T)
    assert ((layer(x).double() - x.double() @ dense.T).abs() <= bound).all()
    assert f"from {first} rows bf16_matmul" in layer.kernel
    below = layer(x[:first - 1])  # the integer kernel, as without the bf16 path
    assert torch.equal(below, qmatmul_kernel().bind(w, "int8x2")(x[:first - 1]))


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_many_rows_run_in_fp32_within_its_rounding(ggml_type, float_path):
    """W^ exact in fp32, x in fp32, one fp32 chain of multiply-adds per output:
    |y - x W^T| <= gamma(K) sum |x| |W^|; below FP32_FROM_ROWS, the integer kernel as before."""
    if f32_kernel() is None:
        pytest.skip("this CPU has no fp32 kernel (neither AVX-512 nor AVX2)")
    w = gguf_weight(ggml_type, out=13)
    first = FP32_FROM_ROWS[qmatmul_kernel().isa, w.bits]
    x = torch.randn(first + 5, 512, generator=torch.Generator().manual_seed(3))
    layer = KernelQuantLinear(w, None, "int8x2", ManyRows(Bf16Tiles(), torch.float32))
    assert torch.equal(qmatmul_kernel().bind(w).dequantize_f32(), pack_f32(dequantize(w)))  # exact panels
    dense = dequantize(w).double()
    bound = gamma(512) * (x.double().abs() @ dense.abs().T)
    got = layer(x)
    assert ((got.double() - x.double() @ dense.T).abs() <= bound).all()
    assert torch.equal(got[:first], layer(x[:first]))  # a row's bits, whatever beside it
    assert f"from {first} rows f32_matmul" in layer.kernel
    below = layer(x[:first - 1])
    assert torch.equal(below, qmatmul_kernel().bind(w, "int8x2")(x[:first - 1]))


def test_many_rows_take_the_float_kernel_this_cpu_runs_faster(float_path):
    """Where both float kernels run, the choice is measured (and the same for every layer)."""
    chosen = many_rows_dtype()
    assert chosen in (None, torch.bfloat16, torch.float32)
    if chosen is not None:
        layer = KernelQuantLinear(gguf_weight(MAPPED[0], out=13), None, "int8x2", ManyRows(Bf16Tiles()))
        assert ("bf16_matmul" if chosen == torch.bfloat16 else "f32_matmul") in layer.kernel
