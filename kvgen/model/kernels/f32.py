"""The compiled AVX-512 fp32 matmul (f32_matmul.c): loading it and calling it.

Built with explicit flags, never -march=native (which would also enable AMX on CPUs that advertise
it, and AMX traps in some VMs), and loaded only where /proc/cpuinfo lists AVX-512 F; elsewhere
`f32_kernel()` is None and fp32 layers use OpenBLAS alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels import KernelCall, build_library, cpu_has

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("f32_matmul.c")
FLAGS = ("-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC")
CPU_FEATURES = ("avx512f",)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Args(ctypes.Structure):
    """`struct f32_matmul_args` of f32_matmul.c."""

    _fields_ = [("x", _P), ("T", _I64), ("K", _I64), ("w", _P), ("N", _I64), ("y", _P), ("num_threads", ctypes.c_int32)]


class F32Matmul:
    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.f32_matmul
        function.argtypes = [_P, _I64, _I64, _P, _I64, _P, ctypes.c_int32]
        function.restype = None
        self._function = function
        self._call = library.f32_matmul_call

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, K] contiguous, weight fp32 [N, K] contiguous -> x @ weight^T [T, N]."""
        self._check(x, weight)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        if x.shape[0]:
            self._function(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr(),
                           torch.get_num_threads())
        return out

    def call(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = x @ weight^T (out fp32 [T, N] contiguous) as a KernelCall."""
        self._check(x, weight)
        assert (x.shape[0] and out.dtype == torch.float32 and out.is_contiguous()
                and out.shape == (x.shape[0], weight.shape[0]))
        args = _Args(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr(),
                     torch.get_num_threads())
        return KernelCall(self._call, args, keep=(x, weight, out))

    @staticmethod
    def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"f32 matmul: x must be contiguous fp32 [T, K], not {x.dtype} {list(x.shape)}")
        if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.shape[1:] != x.shape[1:]:
            raise ValueError(f"f32 matmul: the weight must be contiguous fp32 [N, {x.shape[1]}], "
                             f"not {weight.dtype} {list(weight.shape)}")


@functools.cache
def f32_kernel() -> F32Matmul | None:
    """The kernel, built once per machine, or None where this CPU lacks AVX-512 F or it cannot be built."""
    if not cpu_has(CPU_FEATURES):
        return None
    try:
        return F32Matmul(ctypes.CDLL(str(build_library(SOURCE, FLAGS))))
    except OSError as e:
        log.warning("f32 matmul kernel unavailable (%s); fp32 layers use OpenBLAS alone", e)
        return None
