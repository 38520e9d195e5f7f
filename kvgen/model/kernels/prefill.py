"""The prefill attention kernel (prefill_attention.c): loading it and calling it.

Built like the decode kernel (kvgen.model.kernels.build: -march=native, never AMX) and
used where that one is (`attention_backend` "auto" / "native" on the CPU), for prompt chunks of one
sequence whose mask is plain causal (`PagedGroup.causal_from`). Without AVX-512, or for a head size
it does not serve, it declines and SDPA runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import FLAGS, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("prefill_attention.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
DECLINED = 2  # prefill_attention's return value for what it does not serve


class _Args(ctypes.Structure):
    """`struct prefill_attention_args` of prefill_attention.c, field for field."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("out", _P), ("queries", _I64), ("q_stride", _I64),
                ("keys", _I64), ("key_stride", _I64), ("first", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("scale", ctypes.c_float), ("bf16", ctypes.c_int32),
                ("num_threads", ctypes.c_int32), ("sinks", _P)]


class PrefillAttention:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.prefill_attention
        self._function.argtypes = [ctypes.POINTER(_Args)]
        self._function.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int,
                 sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """q [Q, heads, D] (queries at positions first .. first + Q - 1), keys / values [kv_heads, L, D]
        with L >= first + Q (a gathered copy: rows past first + Q are padding, never read), sinks
        [heads] (a logit per head in each softmax's denominator) or None -> causal attention
        [Q, heads, D] in q's dtype; None where the kernel declines (then SDPA)."""
        num_queries, heads, head_dim = q.shape
        kv_heads, length, _ = keys.shape
        if (keys.dtype not in (torch.float32, torch.bfloat16) or values.dtype != keys.dtype
                or keys.stride() != values.stride() or keys.stride()[1:] != (head_dim, 1)
                or length < first + num_queries):
            return None
        queries = q if q.dtype == torch.float32 and q.stride()[1:] == (head_dim, 1) else q.float().contiguous()
        out = torch.empty(num_queries, heads, head_dim)
        sinks = None if sinks is None else sinks.to(torch.float32).contiguous()  # [heads]
        args = _Args(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), num_queries,
                     queries.stride(0), first + num_queries, keys.stride(0) // head_dim, first, heads, kv_heads,
                     head_dim, head_dim**-0.5, int(keys.dtype == torch.bfloat16), torch.get_num_threads(),
                     None if sinks is None else sinks.data_ptr())
        status = self._function(ctypes.byref(args))
        if status == DECLINED:
            return None
        if status:
            raise MemoryError("prefill attention: out of memory for its scratch space")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


@functools.cache
def prefill_attention_kernel() -> PrefillAttention | None:
    """The kernel, built once per machine, or None where it cannot be built (then SDPA runs)."""
    try:
        return PrefillAttention(ctypes.CDLL(str(build_library(SOURCE, FLAGS))))
    except OSError as e:
        log.warning("prefill attention kernel unavailable (%s); prompt chunks attend through SDPA", e)
        return None
