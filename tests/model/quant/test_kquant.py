"""The K-quant layout (kquant_format), its packer (kquant_pack.c) and kernel (kquant.c): the layout's
values are gguf's bit for bit, the packer writes the numpy oracle's bytes, and the kernel is within
a derived bound of the dequantized matmul at 1, few and many rows.

The bound. x is quantized per 32 as qmatmul.c does (bounds.py), x^ = sum over parts of s q. Per
32-column span and row of x the kernel computes dot = sum q_w q_x exactly in int32 (with Q6_K's
-32 * sum q_x in it), then y = fma(fl(dot * s_x), d*sc, y) (once per 16 columns for Q6_K) and, for
a min, y = fma(-dmin*m, fl(s_x * sum q_x), y); d*sc and dmin*m are exact in fp32. So each of at
most K/16 chained fp32 operations adds at most 2 ulps of the running terms' magnitudes (the product
rounded, then the sum), and two parts add one more rounding:
    |y - x^ W^T| <= (2 K / 16 + 4) * 2^-24 * sum_parts |x^_part| @ (|d sc (q - o)| + |dmin m|)^T
and against x itself the activations' step adds bounds.py's term.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvgen.model.formats.gguf_blocks import k_fields
from kvgen.model.formats.kquant import KPacked, dequantize, dequantize_rows
from kvgen.model.kernels.kquant import kquant_build, kquant_kernel
from kvgen.model.kernels.qmatmul import BUILDS
from kvgen.model import linear, quant_linear
from kvgen.model.kernels.bf16 import Bf16Tiles
from kvgen.model.linear import ONEDNN_FROM_ROWS
from kvgen.model.quant_linear import MANY_ROWS, KQuantLinear
from tests.model.quant.kquant_oracle import pack_k
from tests.model.quant.raw_blocks import raw_matrix
from tests.support.tolerances import gamma
from tests.support.torch_threads import torch_threads

Q = GGMLQuantizationType
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
U = 2.0 ** -24
needs_kernel = pytest.mark.skipif(kquant_kernel() is None,
                                  reason="CPU with neither AVX-512 VNNI nor AVX2: no K-quant kernel")


def packed(ggml_type: Q, out: int = 37, cols: int = 512, seed: int = 0) -> tuple[KPacked, np.ndarray]:
    """37 rows: two full panels of 16 and a ragged third."""
    raw = raw_matrix(ggml_type, out, cols, seed)
    return pack_k(ggml_type, raw, (out, cols)), raw


def magnitudes(ggml_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """|d sc (q - o)| + |dmin m| per weight, float64 [out, in], from the file's integers."""
    out, cols = shape
    f = k_fields(ggml_type, raw.reshape(out, cols // 256, -1))
    group = 16 if ggml_type == Q.Q6_K else 32
    q = f.q.astype(np.float64).reshape(out, cols // 256, 256 // group, group) - (32 if ggml_type == Q.Q6_K else 0)
    terms = np.abs(q * (f.d * f.sc.astype(np.float64))[..., None])
    if f.m is not None:
        terms = terms + np.abs(f.dmin * f.m.astype(np.float64))[..., None]
    return torch.from_numpy(terms.reshape(out, cols))


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_layout_holds_gguf_values_bit_for_bit(ggml_type):
    w, raw = packed(ggml_type)
    want = gguf_dequantize(raw, ggml_type).reshape(w.shape)
    assert np.array_equal(dequantize(w).numpy(), want)
    rows = torch.tensor([36, 0, 17, 16, 36])
    assert np.array_equal(dequantize_rows(w, rows).numpy(), want[rows.numpy()])
    if kquant_kernel() is not None:
        assert np.array_equal(kquant_kernel().rows(w, rows).numpy(), want[rows.numpy()])
        bf16_rows = kquant_kernel().bind(w, 1).dequantize_bf16_rows()  # one fp32 rounding, as gguf's, then bf16's
        assert torch.equal(bf16_rows, torch.from_numpy(want).bfloat16())
    assert w.nbytes * 8 / (48 * 512) == {Q.Q4_K: 4.625, Q.Q5_K: 5.625, Q.Q6_K: 6.625}[ggml_type]


@needs_kernel
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 12, 13, 70])
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_kernel_equals_dequantized_matmul(ggml_type, rows, parts):
    """A panel meets up to 12 rows of x in one pass (AVX-512; AVX2: 8), more 8 a pass and the rest in
    one. Rows in two parts count twice: 7 are one pass, or 8 and 6; 5 in two parts, a K = 4
    verify's, one pass (AVX2: 8 and 2); 12 one pass (AVX2: 8 and 4), or 8, 8 and 8; 13 are 8 and 5;
    70 are two chunks of x's rows (64 + 6)."""
    w, raw = packed(ggml_type, seed=rows)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)) * 2
    kernel = kquant_kernel()
    y = kernel.bind(w, parts).run(x).double()
    q, s = kernel.quantize_activations(x, parts)
    spans = s.double().repeat_interleave(32, dim=2)                   # [parts, T, K]
    x_parts = q.double() * spans
    w_hat = dequantize(w).double()
    accumulation = (2 * w.shape[1] / 16 + 4) * U * sum(p.abs() @ magnitudes(ggml_type, raw, w.shape).T
                                                        for p in x_parts)
    assert ((y - x_parts.sum(0) @ w_hat.T).abs() <= accumulation).all()
    step = spans[-1] * (0.5 + 4 * 127 * U)
    if parts == 2:
        step = step + 2 * U * (x.double().abs() + spans[0])
    assert ((y - x.double() @ w_hat.T).abs() <= accumulation + step @ w_hat.abs().T).all()


@needs_kernel
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_threads_share_chunks_of_rows_without_changing_a_bit(ggml_type):
    """150 rows are three chunks of x, which two threads take panel by panel without waiting for
    each other between chunks: every row the same bits as on one thread."""
    w, _ = packed(ggml_type, out=53, cols=512)
    x = torch.randn(150, w.shape[1], generator=torch.Generator().manual_seed(2))
    bound = kquant_kernel().bind(w, 1)
    with torch_threads(1):
        alone = bound.run(x)
    with torch_threads(2):
        assert torch.equal(bound.run(x), alone)

@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_every_build_this_cpu_runs_gives_the_same_bits(ggml_type, parts):
    """AVX-512 VNNI and AVX2 run the same integer sums and the same fp32 steps in the same order, so
    a CPU with both gets one answer from either, packing included, at 1, few and many rows."""
    builds = [kernel for kernel in (kquant_build(isa) for isa, _, _ in BUILDS) if kernel is not None]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs {len(builds)} of the builds ({', '.join(b.isa for b in builds) or 'none'})")
    raw = raw_matrix(ggml_type, 37, 512, seed=4)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4))
    first, *others = [kernel.pack(ggml_type, [raw]) for kernel in builds]
    assert all(torch.equal(first.data, other.data) for other in others)
    for rows in (1, 3, 5, 12, 13, 70):
        want = builds[0].bind(first, parts).run(x[:rows])
        assert all(torch.equal(kernel.bind(first, parts).run(x[:rows]), want) for kernel in builds[1:])


@needs_kernel
def test_layer_runs_one_part_from_many_rows_and_its_call_matches():
    """Below MANY_ROWS rows a row's result is the same alone or with others, and the fused step's
    KernelCall computes it too; from MANY_ROWS on x goes in one int8 part."""
    w, _ = packed(Q.Q4_K, out=40, cols=256)
    layer = KQuantLinear(w, None, "int8x2")
    x = torch.randn(MANY_ROWS, 256, generator=torch.Generator().manual_seed(1))
    few = layer(x[:3])
    assert torch.equal(few[1:2], layer(x[1:2]))
    assert torch.equal(layer(x), kquant_kernel().bind(w, 1).run(x))
    assert layer.call(x, torch.empty(MANY_ROWS, 40)) is None
    assert "kq_matmul_q4_k" in layer.kernel and layer.weight_bytes == w.nbytes


@needs_kernel
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_prefill_rows_run_on_onednn_where_it_measures_faster(ggml_type, monkeypatch):
    """Forced here (as if oneDNN measured faster), so that every host runs the path AMX hosts take:
    x and W^ rounded to bf16 (relative u = 2^-8), summed in fp32, the sums rounded to bf16:
    |y - x W^T| <= ((1 + u)^3 - 1 + gamma(K) (1 + u)^3) sum |x| |W^|; below ONEDNN_FROM_ROWS rows,
    the K-quant kernel as before."""
    if not linear.has_onednn_bf16():
        pytest.skip("oneDNN has no bf16 GEMM on this CPU")
    monkeypatch.setattr(quant_linear, "onednn_beats", lambda rival: True)
    w, raw = packed(ggml_type, out=40, cols=256)
    layer = KQuantLinear(w, None, "int8x2", Bf16Tiles())
    x = torch.randn(ONEDNN_FROM_ROWS + 3, 256, generator=torch.Generator().manual_seed(2))
    dense = dequantize(w).double()
    u = 2.0 ** -8
    bound = ((1 + u) ** 3 - 1 + gamma(256) * (1 + u) ** 3) * (x.double().abs() @ dense.abs().T)
    assert ((layer(x).double() - x.double() @ dense.T).abs() <= bound).all()
    assert f"from {ONEDNN_FROM_ROWS} onednn" in layer.kernel
    assert torch.equal(layer(x[:ONEDNN_FROM_ROWS - 1]), kquant_kernel().bind(w, 1).run(x[:ONEDNN_FROM_ROWS - 1]))


@needs_kernel
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_packer_writes_the_oracles_bytes(ggml_type):
    """Random blocks (every code and scale bit pattern): one matrix with a ragged last panel, and a
    stack of a row-permuted copy and a view of whole rows (q/k/v, gate/up) whose panels straddle
    the parts, packed in one call with two threads."""
    pack = kquant_kernel().pack
    for out, cols, seed in ((37, 512, 0), (16, 256, 1), (5, 768, 2)):
        raw = raw_matrix(ggml_type, out, cols, seed)
        assert np.array_equal(pack(ggml_type, [raw]).data.numpy(), pack_k(ggml_type, raw, (out, cols)).data.numpy())
    first, second = raw_matrix(ggml_type, 20, 512, 3), raw_matrix(ggml_type, 30, 512, 4)
    order = np.random.default_rng(5).permutation(20)
    with torch_threads(2):
        got = pack(ggml_type, [first[order], second[3:12]])
    want = pack_k(ggml_type, np.concatenate([first[order], second[3:12]]), (29, 512))
    assert got.shape == want.shape and np.array_equal(got.data.numpy(), want.data.numpy())


@needs_kernel
def test_packer_refuses_other_types_and_wrong_widths():
    pack = kquant_kernel().pack
    with pytest.raises(ValueError, match="K-quant"):
        pack(Q.Q4_0, [raw_matrix(Q.Q4_0, 4, 256)])
    with pytest.raises(ValueError, match="K-quant"):
        pack(Q.Q4_K, [raw_matrix(Q.Q4_K, 4, 256), raw_matrix(Q.Q4_K, 4, 512)])
    with pytest.raises(ValueError, match="K-quant"):
        pack(Q.Q6_K, [raw_matrix(Q.Q6_K, 4, 256)[:, :100]])
