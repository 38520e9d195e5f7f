"""The compiled AVX-512 BF16 matmul (bf16_matmul.c): packing a weight for it, loading it, calling it.

Built with explicit flags, never -march=native (which would also enable AMX on CPUs that advertise
it, and AMX traps in some VMs), and loaded only where /proc/cpuinfo lists every feature the flags
use; elsewhere `bf16_kernel()` is None and bf16 layers use oneDNN or `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.model.kernels.build import KernelCall, build_library, cpu_has

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_matmul.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
TILE_ROWS, SPAN = 4, 32  # the kernel's weight tile: 4 rows, stored 32 columns at a time
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> the kernel's layout [ceil(N/4), ceil(K/32), 4, 32], zero-padded: each tile of
    4 rows span by span, so that a tile is one sequential stream."""
    n, k = weight.shape
    padded = F.pad(weight.to(torch.bfloat16), (0, -k % SPAN, 0, -n % TILE_ROWS))
    rows, cols = padded.shape
    return padded.view(rows // TILE_ROWS, TILE_ROWS, cols // SPAN, SPAN).transpose(1, 2).contiguous()


class Bf16Tiles:
    """One growable buffer, which a model's layers share for their weights laid out anew at many rows:
    dequantized into this kernel's tiles, the fp32 kernel's panels or row-major bf16 for oneDNN
    (kvgen.model.quant_linear), decoded or unpacked to row-major for oneDNN (kvgen.model.linear).
    Each layer's copy lives only during its own call, and a fresh multi-MB tensor per call is
    page-faulted in every time."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the buffer (valid until the next take)."""
        size = math.prod(shape) * dtype.itemsize
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer[:size].view(dtype).view(shape)


class _Args(ctypes.Structure):
    """`struct bf16_matmul_args` of bf16_matmul.c."""

    _fields_ = [("x", _P), ("T", _I64), ("K", _I64), ("w", _P), ("N", _I64), ("y", _P), ("f32", ctypes.c_int32),
                ("num_threads", ctypes.c_int32)]


class Bf16Matmul:
    pack = staticmethod(pack)

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.bf16_matmul
        function.argtypes = [_P, _I64, _I64, _P, _I64, _P, ctypes.c_int32, ctypes.c_int32]
        function.restype = None
        self._function = function
        self._call = library.bf16_matmul_call
        self._unpack = library.bf16_unpack
        self._unpack.argtypes = [_P, _I64, _I64, _P, ctypes.c_int32]
        self._unpack.restype = None

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x bf16 [T, K] contiguous, `packed` from pack() of a [out_features, K] weight -> [T, out_features]
        in `out_dtype`: bf16, or float32 for the unrounded fp32 sums."""
        self._check(x, packed, out_features, out_dtype)
        out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
        if x.shape[0]:
            self._function(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), out_features, out.data_ptr(),
                           out_dtype == torch.float32, torch.get_num_threads())
        return out

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int, tiles: Bf16Tiles) -> torch.Tensor:
        """`packed` back to row-major bf16 [out_features, in_features], in `tiles`' buffer."""
        assert packed.shape[:2] == (-(-out_features // TILE_ROWS), -(-in_features // SPAN))
        out = tiles.take((out_features, in_features))
        self._unpack(packed.data_ptr(), out_features, in_features, out.data_ptr(), torch.get_num_threads())
        return out

    def call(self, x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out [T, out_features] (bf16 or fp32, contiguous) = this kernel on x, as a KernelCall."""
        self._check(x, packed, out.shape[1], out.dtype)
        assert x.shape[0] and out.is_contiguous() and out.shape[0] == x.shape[0]
        args = _Args(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), out.shape[1], out.data_ptr(),
                     out.dtype == torch.float32, torch.get_num_threads())
        return KernelCall(self._call, args, keep=(x, packed, out))

    @staticmethod
    def packed_bytes(packed: torch.Tensor) -> int:
        return packed.numel() * packed.element_size()

    @staticmethod
    def _check(x: torch.Tensor, packed: torch.Tensor, out_features: int, out_dtype: torch.dtype) -> None:
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"bf16 matmul: x must be contiguous bf16 [T, K], not {x.dtype} {list(x.shape)}")
        if packed.shape[:2] != (-(-out_features // TILE_ROWS), -(-x.shape[1] // SPAN)):
            raise ValueError(f"bf16 matmul: x [{x.shape[1]} columns] does not fit the packed weight "
                             f"{list(packed.shape)}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"bf16 matmul: out_dtype must be bfloat16 or float32, not {out_dtype}")


@functools.cache
def bf16_kernel() -> Bf16Matmul | None:
    """The kernel, built once per machine, or None where this CPU lacks its features or it cannot be
    built."""
    if not cpu_has(CPU_FEATURES):
        return None
    try:
        return Bf16Matmul(ctypes.CDLL(str(build_library(SOURCE, FLAGS))))
    except OSError as e:
        log.warning("bf16 matmul kernel unavailable (%s); bf16 layers use oneDNN", e)
        return None
