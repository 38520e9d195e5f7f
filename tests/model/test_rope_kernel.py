"""The RoPE kernel (kvgen/model/kernels/rope.c) against apply_rope: the same bits, since each product
and sum is rounded once to the element type in both (the kernel is built without fused
multiply-adds)."""

import pytest
import torch

from kvgen.config import ModelConfig
from kvgen.model.kernels.rope import rope_kernel
from kvgen.model.layers import RotaryEmbedding, apply_rope, make_rope

pytestmark = pytest.mark.skipif(rope_kernel() is None, reason="no C compiler for the kernel")

CPU = torch.device("cpu")


def tables(rows: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(vocab_size=32, hidden_size=4 * dim, intermediate_size=8, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=dim, max_position_embeddings=4096, rope_theta=1e5)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(rows))
    return RotaryEmbedding(config, 4096, CPU, dtype).tables(positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dim", [64, 32])
def test_rotates_in_place_with_apply_ropes_bits(dtype, rows, dim):
    """q and k heads at the front of a q/k/v row (strided rows), as the model hands them over."""
    torch.manual_seed(rows)
    heads, kv_heads = 9, 3
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim) * 4).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    cos, sin = tables(rows, dim, dtype)
    want = apply_rope(qk, cos, sin)
    rope_kernel()(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


def test_cpu_models_take_the_kernel():
    x = torch.randn(2, 3, 16)
    cos, sin = tables(2, 16, torch.float32)
    want = apply_rope(x, cos, sin)
    rotated = make_rope(CPU, torch.float32)(x, cos, sin)
    assert rotated.data_ptr() == x.data_ptr() and torch.equal(rotated, want)
    assert make_rope(CPU, torch.float16) is apply_rope


def test_mismatched_operands_are_refused():
    cos, sin = tables(2, 16, torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        rope_kernel()(torch.randn(2, 3, 16).bfloat16(), cos, sin)
    with pytest.raises(ValueError, match="contiguous heads"):
        rope_kernel()(torch.randn(2, 16, 3).transpose(1, 2), cos, sin)
