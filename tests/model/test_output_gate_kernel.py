"""The output gate of Qwen3.5's gated attention (kvgen/model/kernels/output_gate.c), x * sigmoid(gate),
against torch's ops on the q/gate layout the block hands it, and as a call of a call list.

Bound: libm's expf and torch's vectorised exp are each within an ulp or two; 1 + e, the reciprocal
and the product round once each: a few ulp apart, 8 u relative at most."""

import pytest
import torch

from kvgen.model.kernels.output_gate import output_gate_kernel
from kvgen.model.kernels.step import step_kernels
from tests.support.tolerances import FP32_UNIT_ROUNDOFF

pytestmark = pytest.mark.skipif(output_gate_kernel() is None, reason="no C compiler for the kernel")


def inputs(rows: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, heads, D]; the gate as the block holds it, each head's second half of a [rows, heads, 2D]
    projection whose rows are wider still (k and v follow)."""
    gen = torch.Generator().manual_seed(rows * heads + dim)
    projected = torch.randn(rows, heads * 2 * dim + 24, generator=gen) * 6
    gate = projected[:, : heads * 2 * dim].view(rows, heads, 2 * dim)[..., dim:]
    return torch.randn(rows, heads, dim, generator=gen), gate


@pytest.mark.parametrize("rows, heads, dim", [(1, 8, 256), (3, 2, 33)])
def test_matches_torch_within_a_few_ulp(rows, heads, dim):
    x, gate = inputs(rows, heads, dim)
    got = output_gate_kernel()(x, gate)
    want = x.reshape(rows, -1) * torch.sigmoid(gate.reshape(rows, -1))
    assert got.shape == want.shape and torch.allclose(got, want, rtol=8 * FP32_UNIT_ROUNDOFF, atol=0)


def test_a_call_gives_the_direct_bits():
    x, gate = inputs(2, 4, 64)
    out = torch.empty(x.shape)
    step_kernels().call_list([output_gate_kernel().call(x, gate, out)])()
    assert torch.equal(out.view(2, -1), output_gate_kernel()(x, gate))


def test_bad_arguments_are_refused():
    x, gate = inputs(2, 4, 64)
    with pytest.raises(ValueError):
        output_gate_kernel()(x, gate.double())
    with pytest.raises(ValueError):
        output_gate_kernel()(x, gate[..., :32])
