"""The fp32 matmul kernel (kvgen/model/kernels/f32_matmul.c) against a float64 reference.

Bound: a product of two fp32 values rounds once (or not at all, fused into the FMA), and the kernel's
fp32 sum of K products errs by at most gamma(K) * sum |x w| in all (tests/support/tolerances.py: gamma(K)
covers the K - 1 additions and the rounding of each product), in whatever order they are summed.
"""

import pytest
import torch

from kvgen.llm import DEFAULT_MODEL
from kvgen.loaders import load_model
from kvgen.model.kernels.f32 import PANEL, f32_kernel, pack, unpacked_rows
from kvgen.model.linear import F32Linear
from kvgen.model.linear_choice import make_linear
from kvgen.model.decoder import DecoderModel
from tests.support.tolerances import gamma

pytestmark = pytest.mark.skipif(f32_kernel() is None, reason="this CPU has no AVX-512")


def reference_and_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exact = x.double() @ w.double().T
    return exact, gamma(x.shape[1] + 1) * (x.double().abs() @ w.double().abs().T)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return f32_kernel()(x, pack(w), w.shape[0])


@pytest.mark.parametrize("shape", [(96, 64), (101, 70), (3, 17), (5, 15), (48, 9), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 14, 15, 17, 64])
def test_matches_the_float64_matmul_within_its_rounding(shape, rows):
    """Shapes with a partial last panel (101, 3, 5, 48: masked stores) and row counts across passes of 14."""
    torch.manual_seed(rows)
    w, x = torch.randn(shape), torch.randn(rows, shape[1])
    y = matmul(x, w)
    exact, bound = reference_and_bound(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it():
    """What speculation's exactness and `none` == `contiguous` rest on: a decode row alone, in a
    verify chunk, or in a prefill of hundreds of rows comes out the same."""
    torch.manual_seed(0)
    w, x = torch.randn(101, 70), torch.randn(300, 70)
    batched = matmul(x, w)
    for r in (0, 1, 5, 8, 299):
        assert torch.equal(matmul(x[r : r + 1].contiguous(), w)[0], batched[r])
    for first, last in ((3, 12), (3, 17), (3, 18)):  # one pass of 9, of 14, passes of 14 + 1
        assert torch.equal(matmul(x[first:last].contiguous(), w), batched[first:last])


def test_the_packed_layout_gives_back_each_weight_row():
    """What a tied embedding looks up (F32Linear.weight_rows), the padding of the last panel aside."""
    w = torch.randn(101, 70)
    packed = pack(w)
    assert packed.shape == (-(-101 // PANEL), 70, PANEL) and packed[-1, :, 101 % PANEL :].eq(0).all()
    ids = torch.tensor([0, 31, 32, 100, 5, 5])
    assert torch.equal(unpacked_rows(packed, ids), w[ids])


def test_fp32_on_this_cpu_takes_the_kernel_with_its_bias():
    torch.manual_seed(1)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(3, 64)
    linear = make_linear(w, b)
    assert isinstance(linear, F32Linear)
    exact, bound = reference_and_bound(x, w)
    total = exact + b.double()  # the bias adds one more fp32 rounding of the sum
    assert ((linear(x).double() - total).abs() <= bound + gamma(1) * total.abs() * 2).all()


def test_bad_operands_are_refused():
    packed = pack(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"weight must be packed fp32 \[1, 96, 32\]"):
        f32_kernel()(torch.randn(1, 96), packed, 8)
    with pytest.raises(ValueError, match=r"weight must be packed fp32 \[2, 64, 32\]"):
        f32_kernel()(torch.randn(1, 64), packed, 40)
    with pytest.raises(ValueError, match="contiguous fp32"):
        f32_kernel()(torch.randn(1, 64).bfloat16(), packed, 8)


def test_a_tied_embedding_looks_its_rows_up_in_the_lm_heads_panels():
    """One copy of a tied table: the embedding keeps none of its own and gives the loaded rows."""
    loaded = load_model(DEFAULT_MODEL)
    model = DecoderModel(loaded.config, loaded.weights)
    assert loaded.config.tie_word_embeddings and isinstance(model.lm_head, F32Linear)
    assert model.embed.table is None
    ids = torch.tensor([0, 1, 31, 32, loaded.config.vocab_size - 1, 1])
    assert torch.equal(model.embed(ids), loaded.weights["model.embed_tokens.weight"][ids])
