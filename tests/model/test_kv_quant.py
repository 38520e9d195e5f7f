"""int8 / fp8 KV quantization: the error bounds its docstring states, and pools that carry their scales."""

import pytest
import torch

from kvgen.model.attention import PagedKVCache
from kvgen.model.kv_quant import dequantize, quantize

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
