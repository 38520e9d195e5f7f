import pytest
import torch

from kvgen.model.attention import sdpa_heads_first, window_mask
from kvgen.model.kv_storage import PagedKVCache


def test_gather_reads_whole_blocks_heads_first_whatever_came_before():
    """Gathers reuse one buffer; a smaller gather after a larger one must still see only its blocks."""
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=5,
                         device=torch.device("cpu"), dtype=torch.float32)
    cache.k[0].copy_(torch.randn_like(cache.k[0]))
    cache.v[0].copy_(torch.randn_like(cache.v[0]))
    k_blocks, v_blocks = cache.blocks(0)  # [kv_heads, blocks, block_size, D]
    for block_ids in ([[2, 0], [1, 3]], [[3]], [[0, 1, 2]]):
        ids = torch.tensor(block_ids)
        keys, values = cache.gather(0, ids)
        expected_k = k_blocks[:, ids].flatten(2, 3).transpose(0, 1)  # [B, kv_heads, N * block_size, D]
        expected_v = v_blocks[:, ids].flatten(2, 3).transpose(0, 1)
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)


def eager_with_sinks(q, k, v, allowed, sinks):
    """transformers' gpt-oss eager attention: q [B, H, Q, D], k/v [B, KV, L, D], allowed [Q, L] bool,
    sinks [H] -> [B, H, Q, D]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(2, 3)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("queries,length,window", [(7, 7, None), (7, 7, 3), (1, 9, None), (4, 12, 5)])
def test_sink_logits_match_transformers_eager(queries, length, window):
    """A sink per head joins the denominator: SDPA with the zero key, causal or through a window mask
    (a decode's query at the end of its keys, a chunk's queries after a prefix), GQA."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, queries, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    allowed = window_mask(torch.arange(length - queries, length), torch.arange(length), window)
    want = eager_with_sinks(q, k, v, allowed, sinks)
    got = sdpa_heads_first(q, k, v, allowed[None, None], False, sinks)
    assert torch.allclose(got, want, atol=1e-6)
    if queries == length and window is None:  # SDPA's own causal flag, no mask given
        assert torch.allclose(sdpa_heads_first(q, k, v, None, True, sinks), want, atol=1e-6)
    plain = sdpa_heads_first(q, k, v, allowed[None, None], False)
    assert not torch.allclose(plain, want, atol=1e-3)  # the sinks take weight off every key


def test_sink_logits_with_sdpas_causal_flag_mask_padded_keys():
    """A paged prompt chunk from position 0 reads whole blocks: keys past its queries are padding,
    masked as SDPA's is_causal masks them (query i reads keys 0..i)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    allowed = torch.ones(5, 8, dtype=torch.bool).tril()
    assert torch.allclose(sdpa_heads_first(q, k, v, None, True, sinks), eager_with_sinks(q, k, v, allowed, sinks),
                          atol=1e-6)
