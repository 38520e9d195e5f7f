"""The prefill attention kernel (kvgen/model/kernels/prefill_attention.c) against SDPA with the same
causal mask, and where it declines."""

import pytest
import torch
import torch.nn.functional as F

from kvgen.model.kernels.build import cpu_has
from kvgen.model.kernels.prefill import prefill_attention_kernel
from tests.support.tolerances import fp32_gap

pytestmark = pytest.mark.skipif(not cpu_has(("avx512f",)), reason="the kernel needs AVX-512 (elsewhere SDPA runs)")


def causal_sdpa(q, keys, values, first):
    """q [Q, heads, D], keys/values [kv_heads, L, D]: query i attends keys 0 .. first + i."""
    num_queries, length = q.shape[0], keys.shape[1]
    mask = torch.arange(length)[None, :] <= first + torch.arange(num_queries)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.float()[None], values.float()[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("queries, first, padding", [(1, 0, 0), (37, 0, 11), (16, 100, 0), (300, 45, 3)])
def test_prefill_attention_equals_causal_sdpa(dtype, kv_heads, group, head_dim, queries, first, padding):
    """Chunks from position 0 and later (a chunked prompt), tiles of 16 queries and blocks of 16
    keys cut anywhere, and gathered keys with padding rows after the last (never read)."""
    gen = torch.Generator().manual_seed(queries + first)
    length = first + queries
    q = torch.randn(queries, kv_heads * group, head_dim, generator=gen).to(dtype)
    keys = torch.randn(kv_heads, length + padding, head_dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, length + padding, head_dim, generator=gen).to(dtype)
    got = prefill_attention_kernel()(q, keys, values, first)
    want = causal_sdpa(q, keys[:, :length], values[:, :length], first)
    assert got.dtype == dtype and got.shape == q.shape
    # Both are fp32 sums over head_dim (scores), then over the keys (softmax, P @ V); the online softmax
    # rescales its running sums once per block of 16 keys. bf16 rounds the output once (2**-8).
    magnitude = values.float().abs().max().item()
    blocks = -(-length // 16)
    tolerance = fp32_gap(head_dim + 2 * length + 2 * blocks, magnitude)
    if dtype == torch.bfloat16:
        tolerance += 2**-8 * magnitude
    assert (got.float() - want).abs().max().item() <= tolerance


def test_a_query_gets_the_same_bits_in_whatever_chunk_it_comes():
    """Each query runs over the same blocks of keys in the same order, whichever queries share its
    tile: a prompt cut into chunks differently attends with the same bits."""
    q, keys, values = torch.randn(70, 9, 64), torch.randn(3, 80, 64), torch.randn(3, 80, 64)
    whole = prefill_attention_kernel()(q, keys, values, 0)
    for start, end in ((0, 25), (25, 70), (60, 70)):
        assert torch.equal(prefill_attention_kernel()(q[start:end].contiguous(), keys, values, start), whole[start:end])


def test_prefill_attention_ignores_what_lies_after_the_last_key():
    q, keys, values = torch.randn(20, 4, 64), torch.randn(2, 40, 64), torch.randn(2, 40, 64)
    want = prefill_attention_kernel()(q, keys, values, 5)
    keys[:, 25:], values[:, 25:] = float("nan"), float("nan")  # rows past first + Q = 25
    assert torch.equal(prefill_attention_kernel()(q, keys, values, 5), want)


@pytest.mark.parametrize("case", ["head size 24", "fp16 keys", "too few keys"])
def test_prefill_attention_declines_what_it_does_not_serve(case):
    head_dim = 24 if case == "head size 24" else 64
    q = torch.randn(8, 4, head_dim)
    keys = torch.randn(2, 8 if case == "too few keys" else 16, head_dim)
    keys = keys.half() if case == "fp16 keys" else keys
    assert prefill_attention_kernel()(q, keys, keys.clone(), 4) is None


@pytest.mark.parametrize("queries, first", [(37, 0), (16, 100)])
def test_sink_logits_join_each_heads_denominator(queries, first):
    """gpt-oss's sinks: the kernel against SDPA with the sink as a zero key (kvgen.model.attention)."""
    from kvgen.model.attention import sdpa_heads_first

    gen = torch.Generator().manual_seed(3)
    length = first + queries
    q, keys, values = (torch.randn(*shape, generator=gen) for shape in ((queries, 6, 64), (2, length, 64),
                                                                        (2, length, 64)))
    sinks = torch.tensor([-3.0, 0.0, 1.0, 2.5, 8.0, -30.0])
    allowed = torch.arange(length)[None, :] <= first + torch.arange(queries)[:, None]
    want = sdpa_heads_first(q.transpose(0, 1)[None], keys[None], values[None], allowed[None, None],
                            sinks=sinks)[0].transpose(0, 1)
    got = prefill_attention_kernel()(q, keys, values, first, sinks)
    tolerance = fp32_gap(64 + 2 * length + 2 * (-(-length // 16)) + 2, values.abs().max().item())
    assert (got - want).abs().max().item() <= tolerance
    assert (got - prefill_attention_kernel()(q, keys, values, first)).abs().max().item() > 100 * tolerance
