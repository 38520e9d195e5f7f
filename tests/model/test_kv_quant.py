"""int8 / fp8 KV quantization: the error bounds its docstring states, and pools that carry their scales."""

import pytest
import torch

from kvgen.cache.sizing import kv_bytes_per_token_of
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.kv_quant import dequantize, key_groups, quantize

CPU = torch.device("cpu")


def rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 32, generator=gen)
    x[3, 1] *= 1000  # an outlier row: its own scale keeps the other rows fine
    x[5, 2] = 0  # an all-zero row stays zero
    return x


def test_int8_errs_by_at_most_half_a_step_per_row():
    x = rows()
    q, scales = quantize(x, torch.int8)
    assert q.dtype == torch.int8 and scales.shape == x.shape[:-1]
    assert (q.abs() <= 127).all() and (q.abs().amax(-1)[scales > 0] == 127).all()
    error = (dequantize(q, scales, torch.float32) - x).abs()
    assert (error <= scales[..., None] / 2 * (1 + 2**-20) + 1e-30).all()
    assert torch.equal(dequantize(q, scales, torch.float32)[5, 2], torch.zeros(32))


def test_fp8_keeps_each_element_within_its_relative_step_and_never_saturates():
    x = rows(1)
    q, scales = quantize(x, torch.float8_e4m3fn)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 448
    back = dequantize(q, scales, torch.float32)
    # e4m3: 3 mantissa bits -> relative error <= 2**-4 for normals; subnormals (below 2**-6 after
    # scaling) err by at most half their spacing, 2**-10, times the scale.
    assert ((back - x).abs() <= x.abs() * 2**-4 + scales[..., None] * 2**-10).all()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_copied_block_carries_its_scales(dtype):
    cache = PagedKVCache(2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, device=CPU, dtype=dtype,
                         compute_dtype=torch.float32)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    for layer in range(2):
        cache.write(layer, torch.arange(4, 8), k, v)  # block 1
    cache.copy_blocks([(1, 3)])
    for layer in range(2):
        keys, values = cache.gather(layer, torch.tensor([[1], [3]]))
        assert torch.equal(keys[0], keys[1]) and torch.equal(values[0], values[1])
        assert (keys[0].transpose(0, 1) - k).abs().max() <= k.abs().max() * 2**-4
    assert cache.nbytes() == 2 * 2 * (2 * 5 * 4 * 8 * 1 + 2 * 5 * 4 * 4)  # values + float32 scales


def test_grouped_scales_keep_an_outlier_channel_to_its_own_group():
    """Keys have outlier channels: with a scale per 16 dimensions, one channel 1000x the others only
    coarsens its own group; one scale per row would flatten all 64."""
    x = rows(2).repeat(1, 1, 2)  # [64, 4, 64]
    x[..., 3] *= 1000
    q, scales = quantize(x, torch.int8, groups=4)
    assert scales.shape == (64, 4, 4)
    error = (dequantize(q, scales, torch.float32) - x).abs()
    assert (error <= scales.repeat_interleave(16, -1) / 2 * (1 + 2**-20) + 1e-30).all()
    row_q, row_scales = quantize(x, torch.int8)
    row_error = (dequantize(row_q, row_scales, torch.float32) - x).abs()
    assert error[..., 16:].max() < row_error[..., 16:].max() / 100


@pytest.mark.parametrize("head_dim, groups", [(64, 4), (128, 8), (40, 1), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_pool_scales_and_their_bytes(head_dim, groups, dtype):
    """A key scale per 16 dimensions (one per row where 16 does not divide head_dim), one per value
    row; what kv-size and the engine's sizing count is what the pools hold."""
    assert key_groups(head_dim) == groups
    cache = PagedKVCache(3, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=head_dim, device=CPU, dtype=dtype,
                         compute_dtype=torch.float32)
    slots = cache.k[0].shape[1]
    assert cache.k_scale[0].shape == ((2, slots, groups) if groups > 1 else (2, slots))
    assert cache.v_scale[0].shape == (2, slots)
    assert cache.nbytes() == slots * kv_bytes_per_token_of(3, 2, head_dim, "int8" if dtype == torch.int8 else "fp8")
    k, v = torch.randn(5, 2, head_dim), torch.randn(5, 2, head_dim)
    cache.write(1, torch.arange(2, 7), k, v)
    keys, values = cache.gather(1, torch.tensor([[0, 1]]))
    step = 2**-7 if dtype == torch.int8 else 2**-4
    assert ((keys[0, :, 2:7].transpose(0, 1) - k).abs() <= step * k.abs().amax(-1, keepdim=True)).all()
    assert ((values[0, :, 2:7].transpose(0, 1) - v).abs() <= step * v.abs().amax(-1, keepdim=True)).all()
