"""Paged decode attention (paged_decode.c): one query per sequence, or a verify chunk's few, reading
K/V in place from the block pool, and the store of a step's K/V into float pools (paged_store.c).

Gathering each sequence's blocks into a padded copy and running SDPA on it reads the KV cache three
times (gather read, gather write, SDPA read) and pads every sequence to the longest; this reads each
allowed key once. At batch 64 of the throughput bench it takes a third of the time of gather + SDPA.
Built for the host (kvgen.model.kernels.build.FLAGS); where it cannot be built
`attention_backend="auto"` falls back to gather + SDPA, which is also the path on CUDA and the CPU
twin the tests compare it with.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library, dtype_functions

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
STORE_SOURCE = Path(__file__).with_name("paged_store.c")
POOL_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
               torch.float16: "paged_decode_f16", torch.int8: "paged_decode_int8",
               torch.float8_e4m3fn: "paged_decode_fp8"}
# Model (query) dtypes the kernel serves (queries are widened to fp32); its pools may be any of
# POOL_DTYPES, whatever the model's dtype: fp16 pools too, and int8 / fp8 with scales.
QUERY_DTYPES = (torch.float32, torch.bfloat16)
# paged_store's element types (`enum store_element`): it reads K/V rows of fp32 or bf16 (QUERY_DTYPES,
# the models it serves) and writes float pools of any of these, rounding to nearest even as torch's
# .to() does; quantized pools go through torch (PagedKVCache.write).
STORE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def stores(source: torch.dtype, pool: torch.dtype) -> bool:
    """Whether paged_store writes K/V rows of `source` into pools of `pool`."""
    return source in QUERY_DTYPES and pool in STORE_KINDS


class _Args(ctypes.Structure):
    """`struct paged_decode_args` of paged_decode.c, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("block_ids", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("batch", ctypes.c_int64), ("queries", ctypes.c_int64), ("q_stride", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("group", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("num_slots", ctypes.c_int64),
        ("blocks_per_seq", ctypes.c_int64), ("block_size", ctypes.c_int64), ("key_groups", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("sinks", ctypes.c_void_p),
    ]


def _block_tables(args: _Args, block_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Points `args` at a group's block_ids [B, N] and mask [B * Q, N * block_size] (bool, a row per
    query); returns the int64 / contiguous tensors it points into, which the caller keeps alive."""
    batch, blocks_per_seq = block_ids.shape
    assert (batch * args.queries == args.batch and mask.shape == (args.batch, blocks_per_seq * args.block_size)
            and mask.dtype == torch.bool)
    block_ids, mask = block_ids.to(torch.int64).contiguous(), mask.contiguous()
    args.block_ids, args.mask, args.blocks_per_seq = block_ids.data_ptr(), mask.data_ptr(), blocks_per_seq
    return block_ids, mask


def _layer(args: _Args, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor) -> None:
    """Points `args` at fp32 queries q [B * Q, heads, D] (heads contiguous, rows q.stride(0) apart), a
    layer's pools [kv_heads, num_slots, D] and fp32 out [B * Q, heads, D] (contiguous)."""
    batch, heads, head_dim = q.shape
    kv_heads, num_slots, _ = k_pool.shape
    assert (batch == args.batch and q.dtype == out.dtype == torch.float32 and q.stride()[1:] == (head_dim, 1)
            and out.is_contiguous() and out.shape == q.shape and k_pool.dtype == v_pool.dtype
            and k_pool.is_contiguous() and v_pool.is_contiguous())
    args.q, args.q_stride, args.k_pool, args.v_pool, args.out = (q.data_ptr(), q.stride(0), k_pool.data_ptr(),
                                                                 v_pool.data_ptr(), out.data_ptr())
    args.kv_heads, args.group, args.head_dim, args.num_slots = kv_heads, heads // kv_heads, head_dim, num_slots
    args.scale = head_dim**-0.5


class _StoreArgs(ctypes.Structure):
    """`struct paged_store_args` of paged_store.c: paged_store's arguments, in order."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_stride", ctypes.c_int64),
                ("v_stride", ctypes.c_int64), ("slots", ctypes.c_void_p), ("T", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("source_kind", ctypes.c_int64), ("pool_kind", ctypes.c_int64), ("k_pool", ctypes.c_void_p),
                ("v_pool", ctypes.c_void_p)]


def _store_arguments(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple:
    """paged_store's arguments, once the tensors are checked (see PagedDecode.store)."""
    kv_heads, num_slots, head_dim = k_pool.shape
    layout = (kv_heads, head_dim, head_dim, 1)  # each token's heads contiguous, rows of head_dim
    if (not stores(k.dtype, k_pool.dtype) or v.dtype != k.dtype or (*k.shape[1:], *k.stride()[1:]) != layout
            or (*v.shape[1:], *v.stride()[1:]) != layout or k.shape[0] != slots.numel()
            or v.shape[0] != slots.numel()):
        raise ValueError(f"paged store: k/v [{slots.numel()}, {kv_heads}, {head_dim}] of fp32 or bf16 with "
                         f"contiguous heads into {k_pool.dtype} pools, not {k.dtype} {list(k.shape)} / "
                         f"{v.dtype} {list(v.shape)}")
    assert (v_pool.dtype == k_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()
            and slots.dtype == torch.int64 and slots.is_contiguous())
    return (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), slots.numel(), kv_heads,
            head_dim, num_slots, STORE_KINDS[k.dtype], STORE_KINDS[k_pool.dtype], k_pool.data_ptr(),
            v_pool.data_ptr())


class PagedDecode:
    """Decode attention over K/V pools [kv_heads, num_slots, D] of fp32, bf16 or fp16, or of int8 / fp8 with
    float32 scales [kv_heads, num_slots], on the CPU; and stores fp32 / bf16 rows into fp32, bf16 or
    fp16 pools."""

    def __init__(self, library: ctypes.CDLL, store_library: ctypes.CDLL) -> None:
        self._functions = dtype_functions(library, POOL_DTYPES, [ctypes.POINTER(_Args)], ctypes.c_int)
        self._store = store_library.paged_store
        self._store.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 6 \
            + [ctypes.c_void_p] * 2
        self._store.restype = None
        self._store_call = store_library.paged_store_call

    def store(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k/v [T, kv_heads, D] of fp32 or bf16 (each token's heads contiguous) into pools
        [kv_heads, num_slots, D] of fp32, bf16 or fp16 at slots [T] (int64), rounded to nearest even
        where the pool is narrower: what PagedKVCache.write does for such pools, bit for bit."""
        self._store(*_store_arguments(k_pool, v_pool, slots, k, v))

    def store_call(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> KernelCall:
        """`store` as a KernelCall over these tensors' memory, whatever it then holds. The pools belong
        to their KV cache, which must outlive the call (kvgen.model.fused checks that it does)."""
        return KernelCall(self._store_call, _StoreArgs(*_store_arguments(k_pool, v_pool, slots, k, v)),
                          keep=(slots, k, v))

    def decode_calls(self, q: torch.Tensor, pools: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                     out: torch.Tensor, queries: int = 1) -> DecodeCalls:
        """Decode attention of one group of sequences in every layer, as KernelCalls: see DecodeCalls."""
        return DecodeCalls(self._functions, q, pools, block_size, out, queries)

    def for_group(self, block_ids: torch.Tensor, block_size: int, mask: torch.Tensor) -> GroupDecode:
        """The call for one group of B sequences of Q queries each: block_ids [B, N] and mask
        [B * Q, N * block_size] (bool), a row per query; what every layer of a step shares is
        converted and filled in once."""
        return GroupDecode(self._functions, block_ids, block_size, mask)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor,
                 block_size: int, mask: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One call: see for_group and GroupDecode.__call__."""
        return self.for_group(block_ids, block_size, mask)(q, k_pool, v_pool, scales, sinks)


class GroupDecode:
    """The kernel call for one group of sequences, for any layer's pools."""

    def __init__(self, functions: dict[torch.dtype, ctypes._CFuncPtr], block_ids: torch.Tensor, block_size: int,
                 mask: torch.Tensor) -> None:
        self._functions = functions
        self._args = _Args(batch=mask.shape[0], queries=mask.shape[0] // block_ids.shape[0], block_size=block_size,
                           num_threads=torch.get_num_threads())
        self._blocks = _block_tables(self._args, block_ids, mask)  # kept alive while args point into them

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B * Q, heads, D], pools [kv_heads, num_slots, D], scales (k [kv_heads, num_slots, G] or
        [kv_heads, num_slots], v [kv_heads, num_slots]) float32 for a quantized pool, sinks [heads] (a
        logit per head in each softmax's denominator, gpt-oss) or None -> [B * Q, heads, D] in q's
        dtype. A key's G scales each cover D / G dimensions, a multiple of 16 unless G is 1."""
        kv_heads, num_slots, _ = k_pool.shape
        args = self._args
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
            assert sinks.shape == (q.shape[1],)
        args.sinks = None if sinks is None else sinks.data_ptr()
        assert (scales is not None) == (k_pool.dtype in (torch.int8, torch.float8_e4m3fn))
        queries = q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()
        out = torch.empty_like(queries)
        _layer(args, queries, k_pool, v_pool, out)
        if scales is not None:
            k_scale, v_scale = scales
            head_dim = k_pool.shape[2]
            groups = k_scale.shape[2] if k_scale.dim() == 3 else 1
            assert (k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.shape[:2] == (kv_heads, num_slots)
                    and v_scale.shape == (kv_heads, num_slots) and k_scale.dtype == v_scale.dtype == torch.float32
                    and head_dim % groups == 0 and (groups == 1 or head_dim // groups % 16 == 0))
            args.k_scale, args.v_scale, args.key_groups = k_scale.data_ptr(), v_scale.data_ptr(), groups
        else:
            args.k_scale = args.v_scale = None
            args.key_groups = 1
        if self._functions[k_pool.dtype](ctypes.byref(args)):
            raise MemoryError("paged decode attention: out of memory for its scratch space")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


class DecodeCalls:
    """Decode attention of one group of sequences in every layer, a KernelCall each (`calls`), over
    fixed queries q [B * Q, heads, D] (heads contiguous, rows q.stride(0) apart: a view into the
    q/k/v projection's output), float pools (k, v) per layer [kv_heads, num_slots, D] and an
    output [B * Q, heads, D] of fp32; the group's block tables change each step (set_blocks). The
    pools belong to their KV cache, which must outlive the calls."""

    def __init__(self, functions: dict[torch.dtype, ctypes._CFuncPtr], q: torch.Tensor,
                 pools: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, out: torch.Tensor,
                 queries: int) -> None:
        self.calls = []
        for k_pool, v_pool in pools:
            assert k_pool.dtype in STORE_KINDS
            args = _Args(batch=q.shape[0], queries=queries, block_size=block_size,
                         num_threads=torch.get_num_threads())
            _layer(args, q, k_pool, v_pool, out)
            self.calls.append(KernelCall(functions[k_pool.dtype], args, keep=(q, out)))
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_blocks(self, block_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """This step's block_ids [B, N] and mask [B * Q, N * block_size] (bool), for every layer's call."""
        first = self.calls[0].args
        self._blocks = _block_tables(first, block_ids, mask)  # kept alive while the calls point into them
        tables = first.block_ids, first.mask, first.blocks_per_seq
        for call in self.calls[1:]:
            call.args.block_ids, call.args.mask, call.args.blocks_per_seq = tables


def paged_decode_for(backend: str, device: torch.device, dtype: torch.dtype,
                     pool_dtype: torch.dtype | None = None) -> PagedDecode | None:
    """The kernel decode attention should use under `backend` (one of kvgen.config.ATTENTION_BACKENDS,
    which EngineConfig checks) for a model of `dtype` over pools of `pool_dtype` (default: the
    same), or None for gather + SDPA. "native" insists on the kernel and says why when it cannot
    have it."""
    if backend == "sdpa":
        return None
    pool_dtype = pool_dtype or dtype
    if device.type != "cpu" or dtype not in QUERY_DTYPES or pool_dtype not in POOL_DTYPES:
        if backend == "native":
            raise ValueError(f"attention_backend 'native' runs on the CPU, for float32 or bfloat16 models over "
                             f"float32, bfloat16, float16, int8 or fp8 pools, not {device.type} {dtype} over "
                             f"{pool_dtype}")
        return None
    try:
        return load_paged_decode()
    except OSError as e:
        if backend == "native":
            raise ValueError(f"attention_backend 'native': the kernel could not be built ({e})") from None
        log.warning("paged decode kernel unavailable (%s); decode attention uses gather + SDPA", e)
        return None


@functools.cache
def load_paged_decode() -> PagedDecode:
    """Builds (once per machine) and loads the kernel and the store; OSError if it cannot."""
    return PagedDecode(*(ctypes.CDLL(str(build_library(source))) for source in (SOURCE, STORE_SOURCE)))
