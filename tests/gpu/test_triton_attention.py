"""The Triton paged-attention kernels against kvgen's torch path (gather + SDPA, PagedAttention with no
CPU kernel) on small shapes: decodes, ragged decode batches, prompt chunks (from 0 and chunked),
ragged verify chunks, per-layer sliding windows, GQA ratios 1-4 (3 too: a group that is no power of
two), head sizes 64/128/256, and every KV pool dtype under fp32, bf16 and fp16 models.

On a CPU-only machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported); with a CUDA device and KVGEN_TEST_CUDA=1 the same tests run the compiled kernels
on the GPU (benchmarks/gpu_check.sh does that).

Tolerance, from the dtypes' rounding: both sides compute softmax(q k^T / sqrt(D)) v, the reference in
the model's compute dtype (SDPA, K/V dequantized to it), the kernel with fp32 scores and accumulator
and one rounding of the output to the compute dtype. A score s carries an error up to about
eps * |s| (q and k rounded to the compute dtype), which moves each softmax weight by a relative
eps * |s| and the output, a convex combination of values, by eps * max|s| * max|v|; the output's own
rounding adds eps * max|v|. So |out - ref| <= 4 * eps * (1 + max|s|) * max|v| (4x for the two sides'
roundings and the sum), plus 64 * eps32 * max|v| for fp32 summation order. eps is the unit
roundoff of the compute dtype (fp32 2^-24, bf16 2^-8, fp16 2^-11); quantized pools go through the
same dequantized values on both sides (the kernel scales in fp32, the reference in the compute
dtype), so they need no extra term beyond the compute dtype's.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = os.environ.get("KVGEN_TEST_CUDA") == "1" and torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from kvgen.gpu.backend import TritonPagedAttention  # noqa: E402
from kvgen.gpu.triton_attention import key_ranges, store_kv  # noqa: E402
from kvgen.model.attention import PagedAttention, PagedGroup, PagedKVCache, PagedMetadata  # noqa: E402
from kvgen.model.kv_quant import STORAGE_DTYPES  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
FAR = 1 << 40
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
BLOCK = 16


def _scenario(starts: list[int], num_queries: int, heads: int, kv_heads: int, head_dim: int,
              compute: torch.dtype, pool: str, window: int | None = None, sinks: int = 0, seed: int = 0):
    """B sequences whose new `num_queries` tokens start at `starts[b]`; their history already in the
    pool (written by torch), their new K/V given to the attention call. Returns both backends' inputs."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(starts)
    lengths = [s + num_queries for s in starts]
    blocks_per_seq = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # sequences' blocks scattered in the pool
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    width = max(blocks_per_seq)
    kv_blocks = torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables])
    k_pos = torch.tensor([[j if j < n * BLOCK else FAR for j in range(width * BLOCK)] for n in blocks_per_seq])
    q_pos = torch.tensor(starts)[:, None] + torch.arange(num_queries)[None, :]
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        recent = k_pos[:, None, :] > q_pos[:, :, None] - window
        mask &= recent | (k_pos[:, None, :] < sinks)
    slot = lambda b, p: tables[b][p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
    caches = []
    for _ in range(2):
        cache = PagedKVCache(1, num_blocks, BLOCK, kv_heads, head_dim, DEVICE, STORAGE_DTYPES[pool],
                             compute_dtype=compute)
        caches.append(cache)
    hist_slots = [slot(b, p) for b in range(batch) for p in range(starts[b])]
    hist = [torch.randn(len(hist_slots), kv_heads, head_dim, generator=gen).to(compute) for _ in range(2)]
    for cache in caches:
        if hist_slots:
            cache.write(0, torch.tensor(hist_slots, device=DEVICE), hist[0].to(DEVICE), hist[1].to(DEVICE))
    new_slots = torch.tensor([slot(b, starts[b] + i) for b in range(batch) for i in range(num_queries)])
    q = torch.randn(batch * num_queries, heads, head_dim, generator=gen).to(compute)
    k = torch.randn(batch * num_queries, kv_heads, head_dim, generator=gen).to(compute)
    v = torch.randn(batch * num_queries, kv_heads, head_dim, generator=gen).to(compute)
    causal_from = starts[0] if batch == 1 and num_queries > 1 and window is None else None
    group = PagedGroup(0, kv_blocks.to(DEVICE), mask[:, None].to(DEVICE), causal_from)
    meta = PagedMetadata(new_slots.to(DEVICE), [group])
    return caches, meta, (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)), max(lengths)


def _check(starts, num_queries, heads, kv_heads, head_dim, compute, pool, window=None, sinks=0):
    caches, meta, (q, k, v), length = _scenario(starts, num_queries, heads, kv_heads, head_dim, compute, pool,
                                                window, sinks)
    ref = PagedAttention(caches[0], meta)(0, q, k, v).float()
    backend = TritonPagedAttention(caches[1], meta)
    out = backend(0, q, k, v).float()
    # the store kernel wrote the new K/V with torch's bits
    assert torch.equal(caches[0].k[0].view(torch.uint8), caches[1].k[0].view(torch.uint8))
    assert torch.equal(caches[0].v[0].view(torch.uint8), caches[1].v[0].view(torch.uint8))
    eps = UNIT_ROUNDOFF[compute]
    max_v = caches[0].gather(0, meta.groups[0].kv_blocks)[1].float().abs().max().item()
    max_s = (q.float().abs().max() * k.float().abs().max() * head_dim ** 0.5).item()  # bound on |q.k|/sqrt(D)
    max_s = min(max_s, 12.0)  # random normal q, k: |s| stays far below the crude bound's worst case
    tol = 4 * eps * (1 + max_s) * max_v + 64 * 2.0 ** -24 * max_v
    err = (out - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    return backend


POOLS = {torch.float32: ["float32", "bfloat16", "float16", "int8", "fp8"],
         torch.bfloat16: ["bfloat16", "float32", "int8", "fp8"],
         torch.float16: ["float16"]}


@pytest.mark.parametrize("compute,pool", [(c, p) for c, pools in POOLS.items() for p in pools])
def test_decode_ragged_batch_every_pool_dtype(compute, pool):
    _check([5, 37, 16, 70], 1, heads=4, kv_heads=2, head_dim=64, compute=compute, pool=pool)


@pytest.mark.parametrize("compute,pool", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                          (torch.float32, "int8"), (torch.bfloat16, "fp8"),
                                          (torch.float16, "float16")])
def test_prefill_chunks_every_pool_dtype(compute, pool):
    _check([0], 40, heads=4, kv_heads=2, head_dim=64, compute=compute, pool=pool)  # a prompt from 0
    _check([24], 35, heads=4, kv_heads=2, head_dim=64, compute=compute, pool=pool)  # a later chunk


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)])
def test_gqa_ratios_decode_and_prefill(heads, kv_heads):
    _check([3, 50], 1, heads, kv_heads, 64, torch.float32, "float32")
    _check([9], 20, heads, kv_heads, 64, torch.float32, "float32")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_sizes(head_dim):
    _check([7, 33], 1, 2, 1, head_dim, torch.bfloat16, "bfloat16")
    _check([16], 18, 2, 1, head_dim, torch.float32, "float32")


@pytest.mark.parametrize("window", [8, 20])
def test_sliding_window_decode_prefill_and_verify(window):
    _check([5, 40, 77], 1, 4, 2, 64, torch.float32, "float32", window=window)
    _check([30], 24, 4, 2, 64, torch.float32, "bfloat16", window=window)
    _check([10, 41, 3], 4, 4, 2, 64, torch.float32, "float32", window=window)  # ragged verify chunks


def test_ragged_verify_chunks_take_the_decode_kernel():
    _check([12, 60, 0], 5, 4, 2, 64, torch.bfloat16, "bfloat16")


def test_ragged_prompt_chunks_take_the_prefill_kernel():
    _check([0, 19], 17, 4, 2, 64, torch.float32, "float32")  # 17 rows a sequence: over the decode kernel's 16


def test_sinks_and_window_fall_back_to_the_torch_path():
    backend = _check([40, 70], 1, 4, 2, 64, torch.float32, "float32", window=8, sinks=4)
    assert backend._ranges[(0, 0)] is None


def test_key_ranges():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    lo, hi, one_run = key_ranges(mask)
    assert lo.tolist() == [1, 0, 0, 0] and hi.tolist() == [3, 4, 0, 3] and not bool(one_run)
    assert bool(key_ranges(mask[:3])[2])


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_store_rounds_to_nearest_even_like_torch(pool, source):
    dtype = STORAGE_DTYPES[pool]
    x = (torch.randn(9, 2, 64) * 3).to(source).to(DEVICE)
    slots = torch.tensor([3, 40, 7, 8, 0, 63, 20, 21, 22], device=DEVICE)
    got = torch.zeros(2, 64, 64, dtype=dtype, device=DEVICE)
    want = got.clone()
    store_kv(got, slots, x)
    want.index_copy_(1, slots, x.transpose(0, 1).to(dtype))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# flash-decoding: the decode kernel cuts each row's key range into splits, a reduce kernel joins them
@pytest.fixture
def fixed_splits(monkeypatch):
    from kvgen.gpu import triton_attention

    def use(n):
        monkeypatch.setattr(triton_attention, "decode_splits", lambda *args: n)
    return use


@pytest.mark.parametrize("splits", [1, 3, 40])  # one (written directly), several, many (most empty)
def test_decode_splits_ragged_batch(fixed_splits, splits):
    fixed_splits(splits)
    # GQA 6: 16-key tiles, so 200 keys span 13 of 40 splits; 5 keys fit in one
    _check([5, 37, 16, 200, 0], 1, heads=12, kv_heads=2, head_dim=64, compute=torch.float32, pool="float32")


@pytest.mark.parametrize("compute,pool", [(c, p) for c, pools in POOLS.items() for p in pools])
def test_decode_splits_every_pool_dtype(fixed_splits, compute, pool):
    fixed_splits(3)
    _check([5, 150, 16], 1, heads=4, kv_heads=2, head_dim=64, compute=compute, pool=pool)  # 64-key tiles: 3 used


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (12, 2), (16, 1)])  # GQA 1, 2, 6; 16 takes tl.dot
def test_decode_splits_gqa_ratios(fixed_splits, heads, kv_heads):
    fixed_splits(4)
    _check([3, 100], 1, heads, kv_heads, 64, torch.float32, "float32")
    _check([60], 1, heads, kv_heads, 64, torch.bfloat16, "bfloat16")


@pytest.mark.parametrize("window", [8, 20, 40])
def test_decode_splits_windows_cross_split_edges(fixed_splits, window):
    fixed_splits(3)  # GQA 6: 16-key tiles, so windows of 20 and 40 keys span 2 and 3 splits
    _check([5, 40, 77, 130], 1, 12, 2, 64, torch.float32, "float32", window=window)
    _check([10, 41, 3], 4, 12, 2, 64, torch.float32, "float32", window=window)  # ragged verify chunks


def test_decode_splits_head_dim_128_bf16(fixed_splits):
    fixed_splits(5)
    _check([7, 133], 1, 12, 2, 128, torch.bfloat16, "bfloat16")


def test_decode_split_count():
    from kvgen.gpu.triton_attention import decode_splits
    cpu = torch.device("cpu")
    assert decode_splits(1, 2, 4096, 16, cpu) == 4  # 2 * 4 "SMs" over 2 programs
    assert decode_splits(1, 2, 32, 16, cpu) == 2  # no more splits than tiles
    assert decode_splits(64, 2, 4096, 16, cpu) == 1
