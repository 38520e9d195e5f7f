"""The compiled fp32 matmul (f32_matmul.c): packing weights for it, loading it, calling it.

One source, two builds: AVX-512 F where the CPU has it, else AVX2 with FMA; both give the same bits
(each output is the same chain of fused multiply-adds). Built with explicit flags, never
-march=native (which would also enable AMX on CPUs that advertise it, and AMX traps in some VMs),
and loaded only where /proc/cpuinfo lists the build's features; elsewhere `f32_kernel()` is None
and fp32 layers use OpenBLAS alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library, cpu_has

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("f32_matmul.c")
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# (ISA flags, the /proc/cpuinfo features they need), the first that fits wins
BUILDS = ((("-mavx512f",), ("avx512f",)), (("-mavx2", "-mfma"), ("avx2", "fma")))
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
PANEL = 32  # output features per panel of the packed layout (f32_matmul.c)


class _Args(ctypes.Structure):
    """`struct f32_matmul_args` of f32_matmul.c."""

    _fields_ = [("x", _P), ("T", _I64), ("K", _I64), ("packed", _P), ("N", _I64), ("y", _P),
                ("num_threads", ctypes.c_int32)]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] -> panels [ceil(N / 32), K, 32]: panel p holds rows 32p .. 32p + 31 as columns,
    zeros past N (f32_matmul.c reads a panel as one stream, 32 outputs per k)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    if n % PANEL:
        weight = torch.cat((weight, weight.new_zeros(panels * PANEL - n, k)))
    return weight.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


def unpacked_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight that `pack` laid out -> [T, K] (a tied embedding's lookup)."""
    return packed[ids // PANEL, :, ids % PANEL]


class F32Matmul:
    pack = staticmethod(pack)
    rows = staticmethod(unpacked_rows)

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.f32_matmul
        function.argtypes = [_P, _I64, _I64, _P, _I64, _P, ctypes.c_int32]
        function.restype = None
        self._function = function
        self._call = library.f32_matmul_call

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x fp32 [T, K] contiguous, `packed` = pack(W) for W [n, K] -> x @ W^T [T, n]."""
        self._check(x, packed, n)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0]:
            self._function(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n, out.data_ptr(),
                           torch.get_num_threads())
        return out

    def call(self, x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = x @ W^T (out fp32 [T, n] contiguous) as a KernelCall."""
        n = out.shape[1]
        self._check(x, packed, n)
        assert x.shape[0] and out.dtype == torch.float32 and out.is_contiguous() and out.shape[0] == x.shape[0]
        args = _Args(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n, out.data_ptr(),
                     torch.get_num_threads())
        return KernelCall(self._call, args, keep=(x, packed, out))

    @staticmethod
    def packed_bytes(packed: torch.Tensor) -> int:
        return packed.numel() * packed.element_size()

    @staticmethod
    def _check(x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"f32 matmul: x must be contiguous fp32 [T, K], not {x.dtype} {list(x.shape)}")
        expected = (-(-n // PANEL), x.shape[1], PANEL)
        if packed.dtype != torch.float32 or not packed.is_contiguous() or packed.shape != expected:
            raise ValueError(f"f32 matmul: the weight must be packed fp32 {list(expected)} (pack() of [{n}, "
                             f"{x.shape[1]}]), not {packed.dtype} {list(packed.shape)}")


@functools.cache
def f32_kernel() -> F32Matmul | None:
    """The kernel, built once per machine for the first of BUILDS this CPU has, or None where it has
    neither or the build fails."""
    flags = next((flags for flags, features in BUILDS if cpu_has(features)), None)
    if flags is None:
        return None
    try:
        return F32Matmul(ctypes.CDLL(str(build_library(SOURCE, (*COMMON_FLAGS, *flags)))))
    except OSError as e:
        log.warning("f32 matmul kernel unavailable (%s); fp32 layers use OpenBLAS alone", e)
        return None
