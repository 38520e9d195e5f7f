"""The compiled paged decode kernel against its CPU twin (gather + SDPA), and how it is chosen."""

import ctypes
import functools
import logging

import pytest
import torch

from kvgen.config import EngineConfig
from kvgen.model.attention import sdpa_heads_first
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.kernels import paged_decode as kernels
from kvgen.model.kernels.build import FLAGS, build_library
from kvgen.model.kernels.paged_decode import SOURCE, STORE_SOURCE, PagedDecode, load_paged_decode, paged_decode_for
from tests.support.tolerances import fp32_gap
from tests.support.torch_threads import torch_threads

CPU = torch.device("cpu")


def built_with(*flags: str) -> PagedDecode:
    """The kernel and its store built with the host's FLAGS and `flags`."""
    libraries = (ctypes.CDLL(str(build_library(source, (*FLAGS, *flags)))) for source in (SOURCE, STORE_SOURCE))
    return PagedDecode(*libraries)


@functools.cache
def portable_paged_decode() -> PagedDecode:
    """The kernel built without AVX-512: its portable loops, which CPUs without AVX-512 run."""
    return built_with("-mno-avx512f")


KERNELS = {"native": load_paged_decode, "portable": portable_paged_decode}


@functools.cache
def no_f16c_paged_decode() -> PagedDecode:
    """The portable loops without F16C too: fp16 pool rows widened by their bits (from_f16), and
    stored by theirs (to_f16)."""
    return built_with("-mno-avx512f", "-mno-f16c")


FLOAT_POOL_KERNELS = {**KERNELS, "no-f16c": no_f16c_paged_decode}


def ragged_batch(dtype: torch.dtype, kv_heads: int, group: int, block_size: int, window: int | None, seed: int = 0,
                 head_dim: int = 32, long: int | None = None):
    """A pool holding 6 sequences of 1..70 keys (and one of `long` keys if given) in shuffled
    blocks; returns (cache, q [B, heads, D], block_ids [B, N] padded with the scratch block,
    mask [B, L]: the keys each query may read)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 70, 17, block_size, block_size + 1, 33, *([long] if long else [])]
    num_blocks = max(160, sum(-(-n // block_size) for n in lengths))
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, CPU, dtype)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    per_seq = [-(-n // block_size) for n in lengths]
    block_ids = torch.full((len(lengths), max(per_seq)), num_blocks)  # the scratch block
    for b, n in enumerate(per_seq):
        block_ids[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    positions = torch.arange(block_ids.shape[1] * block_size)
    last = torch.tensor(lengths)[:, None] - 1
    mask = positions[None, :] <= last
    if window is not None:
        mask &= positions[None, :] > last - window
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen).to(dtype)
    return cache, q, block_ids, mask


def gather_and_sdpa(cache, q, block_ids, mask):
    keys, values = cache.gather(0, block_ids)
    return sdpa_heads_first(q[:, :, None], keys, values, mask[:, None, None])[:, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (2, 3), (3, 4), (2, 15)])  # 15: tiles of 8, 4, 2 and 1 heads
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 512])  # 64 to 512 take the constant-size loops
@pytest.mark.parametrize("build", KERNELS)  # with AVX-512 those sizes take attend_avx512
def test_paged_decode_equals_gather_and_sdpa(dtype, kv_heads, group, block_size, window, head_dim, build):
    cache, q, block_ids, mask = ragged_batch(dtype, kv_heads, group, block_size, window, head_dim=head_dim)
    got = KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, block_size, mask)
    want = gather_and_sdpa(cache, q, block_ids, mask)
    assert got.dtype == dtype and got.shape == want.shape
    # fp32: scores over head_dim, softmax and P @ V over the keys; bf16: both round the output once
    # (2**-8 relative) after fp32 sums that differ, so they may land one bf16 step apart.
    values = cache.v[0].float().abs().max().item()
    keys = int(mask.sum(-1).max())
    tolerance = fp32_gap(q.shape[-1] + 2 * keys, values) if dtype == torch.float32 else 2 * 2**-8 * values
    assert (got.float() - want.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, window", [(16, None), (7, None), (16, 300)])
@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("build", KERNELS)
def test_long_sequences_merge_their_spans(dtype, block_size, window, head_dim, build):
    """A sequence of 1,000 keys is cut into spans of 256 positions (partial softmaxes, merged): block
    edges that do not line up with the spans, a window that empties the first spans."""
    cache, q, block_ids, mask = ragged_batch(dtype, 3, 3, block_size, window, head_dim=head_dim, long=1000)
    got = KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, block_size, mask)
    want = gather_and_sdpa(cache, q, block_ids, mask)
    values = cache.v[0].float().abs().max().item()
    keys = int(mask.sum(-1).max())
    tolerance = fp32_gap(q.shape[-1] + 2 * keys, values) if dtype == torch.float32 else 2 * 2**-8 * values
    assert (got.float() - want.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (3, 4)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [32, 40, 48, 64, 256])  # keys: 2, 1 (40 is no multiple of 16), 3, 4, 16 scales
@pytest.mark.parametrize("build", KERNELS)
def test_paged_decode_reads_quantized_pools_as_their_dequantized_values(pool_dtype, kv_heads, group, block_size,
                                                                        head_dim, build):
    """The kernel scales int8 / fp8 rows in registers; gather + SDPA dequantizes a copy. Both attend
    over the same dequantized values, so they differ by fp32 rounding only."""
    float_cache, q, block_ids, mask = ragged_batch(torch.float32, kv_heads, group, block_size, window=None,
                                                   head_dim=head_dim)
    cache = PagedKVCache(1, float_cache.num_blocks, block_size, kv_heads, q.shape[-1], CPU, pool_dtype,
                         compute_dtype=torch.float32)
    slots = torch.arange(cache.k[0].shape[1])
    cache.write(0, slots, float_cache.k[0].transpose(0, 1), float_cache.v[0].transpose(0, 1))
    scales = (cache.k_scale[0], cache.v_scale[0])
    got = KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, block_size, mask, scales)
    want = gather_and_sdpa(cache, q, block_ids, mask)
    keys = int(mask.sum(-1).max())
    values = float_cache.v[0].abs().max().item()
    assert (got - want).abs().max().item() <= fp32_gap(q.shape[-1] + 2 * keys, values)
    # ...and quantization moved the result by about the quantization step, not more.
    exact = gather_and_sdpa(float_cache, q, block_ids, mask)
    step = 2**-7 if pool_dtype == torch.int8 else 2**-3  # relative: 1/127 of the row max; fp8's 3 bits
    assert (got - exact).abs().max().item() <= 4 * step * values


@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("build", KERNELS)
def test_paged_decode_applies_each_key_group_scale_to_its_own_dimensions(pool_dtype, head_dim, build):
    """Keys with outlier channels (a few dimensions 30x the rest, as RoPE'd keys have): each group
    of 16 dimensions has its own scale, and the kernel must multiply each partial dot product by
    the right one. Against gather + SDPA over the same pool, and close to the float keys."""
    float_cache, q, block_ids, mask = ragged_batch(torch.float32, 3, 3, 16, window=None, head_dim=head_dim, seed=3)
    float_cache.k[0][:, :, 5] *= 30  # group 0
    float_cache.k[0][:, :, head_dim // 2 + 5] *= 30  # its RoPE partner, in a middle group
    cache = PagedKVCache(1, float_cache.num_blocks, 16, 3, head_dim, CPU, pool_dtype, compute_dtype=torch.float32)
    assert cache.k_scale[0].shape == (3, cache.k[0].shape[1], head_dim // 16) and cache.v_scale[0].dim() == 2
    slots = torch.arange(cache.k[0].shape[1])
    cache.write(0, slots, float_cache.k[0].transpose(0, 1), float_cache.v[0].transpose(0, 1))
    got = KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, 16, mask, (cache.k_scale[0], cache.v_scale[0]))
    want = gather_and_sdpa(cache, q, block_ids, mask)
    keys = int(mask.sum(-1).max())
    values = float_cache.v[0].abs().max().item()
    assert (got - want).abs().max().item() <= fp32_gap(head_dim + 2 * keys, values)
    # the groups without an outlier keep their own fine steps: keys dequantize close to the floats there
    gathered, _ = cache.gather(0, block_ids)
    exact, _ = float_cache.gather(0, block_ids)
    quiet = [d for d in range(head_dim) if d // 16 not in (0, (head_dim // 2 + 5) // 16)]
    step = 2**-7 if pool_dtype == torch.int8 else 2**-4
    assert ((gathered - exact)[..., quiet].abs() <= step * exact[..., quiet].abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                               (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("build", FLOAT_POOL_KERNELS)
def test_paged_decode_reads_pools_of_another_float_dtype(dtype, pool_dtype, block_size, head_dim, build):
    """A model of `dtype` over float pools of `pool_dtype` (--kv-cache-dtype): the cache rounds what the
    model writes into the pool; the kernel widens pool rows in registers, gather + SDPA converts a
    copy to the model's dtype. Each case's pool holds values the model's dtype holds too (fp32 over
    bf16 / fp16; bf16 over fp32 holding bf16 values, or over fp16, whose 11 bits hold bf16's 8 in
    its normal range; its subnormals below 2**-14 err by 2**-25 at most, far below the bound), so
    both attend over the same values: fp32 rounding apart, plus one bf16 rounding of the output
    each (2**-8 relative) for a bf16 model."""
    source, q, block_ids, mask = ragged_batch(dtype, 3, 4, block_size, None, head_dim=head_dim)
    cache = PagedKVCache(1, source.num_blocks, block_size, 3, head_dim, CPU, pool_dtype, compute_dtype=dtype)
    slots = torch.arange(cache.k[0].shape[1])
    cache.write(0, slots, source.k[0].transpose(0, 1), source.v[0].transpose(0, 1))
    assert cache.k[0].dtype == pool_dtype and torch.equal(cache.k[0], source.k[0].to(pool_dtype))
    got = FLOAT_POOL_KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, block_size, mask)
    want = gather_and_sdpa(cache, q, block_ids, mask)
    assert got.dtype == want.dtype == dtype
    values = cache.v[0].float().abs().max().item()
    keys = int(mask.sum(-1).max())
    tolerance = fp32_gap(head_dim + 2 * keys, values) + (2 * 2**-8 * values if dtype == torch.bfloat16 else 0)
    assert (got.float() - want.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("build", FLOAT_POOL_KERNELS)
def test_every_finite_fp16_value_widens_exactly(build):
    """Each query attends one key (softmax weight exactly 1), so its output is that key's value row
    as the kernel widened it: every finite half, through F16C, AVX-512 or the bits (from_f16)."""
    halves = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[torch.isfinite(halves)]
    head_dim = 16 if build != "native" else 64  # 64 takes attend_avx512's _mm512_cvtph_ps
    rows = torch.nn.functional.pad(halves, (0, -halves.numel() % head_dim)).view(-1, head_dim)
    cache = PagedKVCache(1, rows.shape[0], 1, 1, head_dim, CPU, torch.float16, compute_dtype=torch.float32)
    cache.v[0][0, : rows.shape[0]] = rows
    block_ids = torch.arange(rows.shape[0])[:, None]
    mask = torch.ones(rows.shape[0], 1, dtype=torch.bool)
    out = FLOAT_POOL_KERNELS[build]()(torch.zeros(rows.shape[0], 1, head_dim), cache.k[0], cache.v[0], block_ids, 1,
                                      mask)
    assert torch.equal(out[:, 0], rows.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("queries", [2, 9])
@pytest.mark.parametrize("build", KERNELS)
@pytest.mark.parametrize("window", [None, 40])
def test_a_verify_chunk_attends_each_query_as_the_decode_of_its_token(dtype, queries, build, window):
    """Q queries per sequence (a speculative verify chunk: query i sees the keys up to its own
    position) give the bits that decoding each of those tokens alone gives, over a block table cut
    to the blocks it needs (as a plain decode's is). So speculation changes no attention output.
    A chunk's rows are scored and summed together where each row's keys are a first part of the
    last row's (causal), and one at a time where a sliding window drops keys at the front."""
    float_cache, _, block_ids, _ = ragged_batch(torch.float32, 3, 3, 4, window=None, head_dim=64, long=600)
    cache = PagedKVCache(1, float_cache.num_blocks, 4, 3, 64, CPU, dtype, compute_dtype=torch.float32)
    stored = dtype if dtype.is_floating_point else torch.float32  # int8 pools quantize what they are given
    cache.write(0, torch.arange(cache.k[0].shape[1]), float_cache.k[0].transpose(0, 1).to(stored),
                float_cache.v[0].transpose(0, 1).to(stored))
    scales = (cache.k_scale[0], cache.v_scale[0]) if dtype == torch.int8 else None
    lengths = torch.tensor([queries, 70, 17, 600])  # keys up to and including each chunk's last token
    block_ids = block_ids[[0, 1, 2, 6]]
    batch = len(lengths)
    positions = torch.arange(block_ids.shape[1] * 4)
    last = lengths[:, None] - queries + torch.arange(queries)[None, :]  # [B, Q]: each query's position
    mask = positions[None, None, :] <= last[:, :, None]
    if window is not None:
        mask &= positions[None, None, :] > last[:, :, None] - window
    mask = mask.view(batch * queries, -1)
    q = torch.randn(batch * queries, 9, 64, generator=torch.Generator().manual_seed(1))
    kernel = KERNELS[build]()
    got = kernel(q, cache.k[0], cache.v[0], block_ids, 4, mask, scales)
    for row in range(batch * queries):
        b, position = row // queries, int(last.flatten()[row])
        needed = position // 4 + 1
        alone = kernel(q[row : row + 1], cache.k[0], cache.v[0], block_ids[b : b + 1, :needed], 4,
                       mask[row : row + 1, : needed * 4], scales)
        assert torch.equal(got[row], alone[0]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_gives_the_same_bits_on_two_threads(dtype):
    """Each (sequence, KV head, span of keys) is one thread's work with its own scores buffer, and
    spans are merged in order (the suite otherwise runs on one thread)."""
    cache, q, block_ids, mask = ragged_batch(dtype, 3, 3, 4, window=None, long=700)
    kernel = load_paged_decode()
    one = kernel(q, cache.k[0], cache.v[0], block_ids, 4, mask)
    with torch_threads(2):
        two = kernel(q, cache.k[0], cache.v[0], block_ids, 4, mask)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 512])
def test_each_query_head_gets_the_bits_it_gets_alone(dtype, head_dim):
    """The heads that share a KV head run in tiles of 8, 4, 2 and 1 that read each key once for the
    tile; a head's output must not depend on the tile it lands in (15 heads: one of each)."""
    kv_heads, group = 2, 15
    cache, q, block_ids, mask = ragged_batch(dtype, kv_heads, group, 16, window=None, head_dim=head_dim, long=300)
    kernel = load_paged_decode()
    together = kernel(q, cache.k[0], cache.v[0], block_ids, 16, mask)
    for head in range(kv_heads * group):
        h = head // group
        alone = kernel(q[:, head:head + 1], cache.k[0][h:h + 1], cache.v[0][h:h + 1], block_ids, 16, mask)
        assert torch.equal(together[:, head], alone[:, 0]), head


@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_paged_decode_ignores_what_the_mask_hides(head_dim):
    """Keys outside the mask (padding, evicted by a window) may hold anything, NaN included."""
    cache, q, block_ids, mask = ragged_batch(torch.float32, 2, 3, 4, window=6, head_dim=head_dim)
    want = load_paged_decode()(q, cache.k[0], cache.v[0], block_ids, 4, mask)
    k_blocks, v_blocks = cache.blocks(0)  # [kv_heads, blocks, block_size, D]
    hidden = ~mask.view(*block_ids.shape, 4)  # [B, N, block_size]
    for b in range(block_ids.shape[0]):
        for n, block in enumerate(block_ids[b].tolist()):
            k_blocks[:, block, hidden[b, n]] = float("nan")
            v_blocks[:, block, hidden[b, n]] = float("nan")
    assert torch.equal(load_paged_decode()(q, cache.k[0], cache.v[0], block_ids, 4, mask), want)


@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_paged_decode_gives_zeros_where_no_key_is_allowed(head_dim):
    cache, q, block_ids, mask = ragged_batch(torch.float32, 2, 2, 4, window=None, head_dim=head_dim)
    mask[2] = False
    out = load_paged_decode()(q, cache.k[0], cache.v[0], block_ids, 4, mask)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isfinite(out).all()


def test_backend_choice():
    assert paged_decode_for("sdpa", CPU, torch.float32) is None
    assert paged_decode_for("auto", CPU, torch.float32) is load_paged_decode()
    assert paged_decode_for("native", CPU, torch.bfloat16) is load_paged_decode()
    assert paged_decode_for("auto", CPU, torch.float16) is None  # fp16 models: gather + SDPA
    with pytest.raises(ValueError, match="float32 or bfloat16 models"):
        paged_decode_for("native", CPU, torch.float16)
    assert paged_decode_for("auto", CPU, torch.float32, torch.int8) is load_paged_decode()
    assert paged_decode_for("auto", CPU, torch.bfloat16, torch.float8_e4m3fn) is load_paged_decode()
    assert paged_decode_for("auto", CPU, torch.float32, torch.float16) is load_paged_decode()  # widened exactly
    assert paged_decode_for("native", CPU, torch.float32, torch.bfloat16) is load_paged_decode()
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_without_a_compiler_auto_falls_back_and_native_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    load_paged_decode.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert paged_decode_for("auto", CPU, torch.float32) is None
        assert "no C compiler" in caplog.text
        with pytest.raises(ValueError, match="could not be built"):
            paged_decode_for("native", CPU, torch.float32)
    finally:
        load_paged_decode.cache_clear()


def hard_values(count: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values that test a rounding: ties (the halfway points of bf16 and of fp16), subnormals of
    fp16, values past fp16's largest (65504: to infinity), infinities, zeros of both signs, and
    ordinary ones of every scale."""
    special = torch.tensor([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-24, 2**-25,
                            3 * 2**-26, 6e-8, 65504.0, 65519.0, 65520.0, 1e6, -1e6, float("inf"), float("-inf"),
                            3.0e38, 1e-40])
    ordinary = torch.randn(count, generator=gen) * torch.exp2(torch.randint(-30, 30, (count,), generator=gen).float())
    return torch.cat([special, -special, ordinary])[:count]


@pytest.mark.parametrize("dtype, pool_dtype", [(d, p) for d in (torch.float32, torch.bfloat16)
                                               for p in (torch.float32, torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("build", FLOAT_POOL_KERNELS)
def test_store_writes_what_the_cache_writes(dtype, pool_dtype, build):
    """k/v as the model hands them over: views into a q/k/v row, each token's heads contiguous, of
    values that test the rounding; into a pool of another float type the store rounds to nearest
    even as torch's .to() does (F16C, or the bits without it), bit for bit."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, head_dim, tokens = 3, 64, 5
    qkv = hard_values(tokens * (9 + 2 * kv_heads) * head_dim, gen).view(tokens, -1).to(dtype)
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([7, 0, 33, 34, 12])
    want, got = (PagedKVCache(1, 4, 16, kv_heads, head_dim, CPU, pool_dtype, compute_dtype=dtype) for _ in range(2))
    want.write(0, slots, k, v)
    FLOAT_POOL_KERNELS[build]().store(got.k[0], got.v[0], slots, k, v)
    assert torch.equal(got.k[0].view(torch.uint8), want.k[0].view(torch.uint8))
    assert torch.equal(got.v[0].view(torch.uint8), want.v[0].view(torch.uint8))


def test_store_refuses_what_it_cannot_write():
    k = torch.randn(2, 3, 64)
    cache = PagedKVCache(1, 4, 16, 3, 64, CPU, torch.float32)
    with pytest.raises(ValueError, match="paged store"):  # k and v of two dtypes
        load_paged_decode().store(cache.k[0], cache.v[0], torch.tensor([0, 1]), k, k.bfloat16())
    with pytest.raises(ValueError, match="paged store"):  # an fp16 model's rows
        load_paged_decode().store(cache.k[0], cache.v[0], torch.tensor([0, 1]), k.half(), k.half())
    quantized = PagedKVCache(1, 4, 16, 3, 64, CPU, torch.int8)
    with pytest.raises(ValueError, match="paged store"):  # quantized pools go through PagedKVCache.write
        load_paged_decode().store(quantized.k[0], quantized.v[0], torch.tensor([0, 1]), k, k)


@pytest.mark.parametrize("head_dim", [32, 64])  # the portable loops and attend_avx512
@pytest.mark.parametrize("window, long", [(None, None), (5, None), (None, 1000), (300, 1000)])
@pytest.mark.parametrize("build", KERNELS)
def test_sink_logits_join_each_heads_denominator(head_dim, window, long, build):
    """gpt-oss's sinks, one spans or several merged (a window emptying the first): the kernel against
    SDPA with the sink as a zero key (kvgen.model.attention), sinks above and below the scores."""
    cache, q, block_ids, mask = ragged_batch(torch.float32, 2, 3, 16, window, head_dim=head_dim, long=long)
    sinks = torch.tensor([-3.0, 0.0, 1.0, 2.5, 8.0, -30.0])
    got = KERNELS[build]()(q, cache.k[0], cache.v[0], block_ids, 16, mask, sinks=sinks)
    keys, values = cache.gather(0, block_ids)
    want = sdpa_heads_first(q[:, :, None], keys, values, mask[:, None, None], sinks=sinks)[:, :, 0]
    tolerance = fp32_gap(head_dim + 2 * int(mask.sum(-1).max()) + 2, cache.v[0].abs().max().item())
    assert (got - want).abs().max().item() <= tolerance
    assert (got - gather_and_sdpa(cache, q, block_ids, mask)).abs().max().item() > 100 * tolerance
