"""fp32 weights in 28 bits each, losslessly, and the kernel that reads them (f32_coded.c).

An fp32 decode step reads every weight once, at the memory's speed. Stored as its low 3 bytes plus a
4-bit code of its top byte (kernels/coding.py), in f32_matmul.c's panels of 32 output features, an
fp32 matrix reads an eighth fewer bytes and gives the same fp32 values. Every output is still one
chain of fused multiply-adds, whatever the row count; an outlier's product is added after it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.model.kernels import KernelCall, build_library, cpu_has
from kvgen.model.kernels.coding import CodedArgs, CodedWeight, OutliersStruct, encode
from kvgen.model.kernels.f32 import COMMON_FLAGS, PANEL

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("f32_coded.c")
FLAGS = (*COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vbmi")
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vbmi")
STEP_BYTES = 112  # a panel's k step: 32 weights' low 3 bytes, then 16 code bytes
_PACK_PANELS = 256  # panels laid out at a time: bounds the int32 intermediates of a large LM head
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def pack(weight: torch.Tensor) -> CodedWeight:
    """fp32 [N, K] -> its coded layout (f32_coded.c's header: panels [ceil(N/32), K, 112]), once at
    load."""
    n, k = weight.shape
    weight = F.pad(weight.float(), (0, 0, 0, -n % PANEL)).contiguous()
    chunks = weight.view(torch.int32).split(_PACK_PANELS * PANEL)  # [rows, K]
    return encode(chunks, 24, PANEL, _layout, weight, (n, k))


def _layout(codes: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Codes and low 3 bytes [rows, K] (rows a multiple of 32) -> panels uint8 [rows/32, K, 112]."""
    rows, k = codes.shape
    codes, low = (t.view(rows // PANEL, PANEL, k).transpose(1, 2) for t in (codes, low))  # [panels, K, 32]
    low_bytes = torch.stack([low & 0xFF, low >> 8 & 0xFF, low >> 16], dim=-1).flatten(2)  # [panels, K, 96]
    nibbles = codes[..., :16] | codes[..., 16:] << 4  # [panels, K, 16]
    return torch.cat([low_bytes, nibbles], dim=2).to(torch.uint8).contiguous()


class CodedF32Matmul:
    """The kernel, with the fp32 kernel's interface (kvgen.model.kernels.f32.F32Matmul) on a coded
    weight (its codes: panels [ceil(N/32), K, 112])."""

    pack = staticmethod(pack)

    def __init__(self, library: ctypes.CDLL) -> None:
        self._call = library.f32_coded_matmul_call
        self._call.argtypes, self._call.restype = [ctypes.POINTER(CodedArgs)], ctypes.c_int
        self._rows = library.f32_coded_rows
        self._rows.argtypes = [_P, _P, OutliersStruct, _I64, _P, _I64, _P]
        self._rows.restype = None

    def __call__(self, x: torch.Tensor, packed: CodedWeight, n: int) -> torch.Tensor:
        """x fp32 [T, K] contiguous, `packed` = pack(W) for W [n, K] -> x @ W^T [T, n]."""
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0] and self._call(ctypes.byref(self._args(x, packed, out))):
            raise MemoryError("f32 coded matmul: no memory for a decoded panel")
        return out

    def call(self, x: torch.Tensor, packed: CodedWeight, out: torch.Tensor) -> KernelCall:
        """out = x @ W^T (out fp32 [T, n] contiguous) as a KernelCall."""
        assert x.shape[0] and out.is_contiguous() and out.shape[0] == x.shape[0]
        return KernelCall(self._call, self._args(x, packed, out), keep=(x, packed, out))

    def rows(self, packed: CodedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight -> fp32 [T, K] (a tied embedding's lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], packed.shape[1])
        self._rows(*packed.pointers(), packed.shape[1], ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out

    @staticmethod
    def packed_bytes(packed: CodedWeight) -> int:
        return packed.nbytes

    @staticmethod
    def _args(x: torch.Tensor, packed: CodedWeight, out: torch.Tensor) -> CodedArgs:
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"f32 matmul: x must be contiguous fp32 [T, K], not {x.dtype} {list(x.shape)}")
        if packed.shape != (out.shape[1], x.shape[1]) or out.dtype != torch.float32:
            raise ValueError(f"f32 matmul: x [{x.shape[1]} columns] does not fit the packed weight {packed.shape}")
        return CodedArgs.of(x, packed, out)


@functools.cache
def coded_f32_kernel() -> CodedF32Matmul | None:
    """The kernel, built once per machine, or None where this CPU lacks its features (AVX-512 VBMI)
    or it cannot be built."""
    if not cpu_has(CPU_FEATURES):
        return None
    try:
        return CodedF32Matmul(ctypes.CDLL(str(build_library(SOURCE, FLAGS))))
    except OSError as e:
        log.warning("coded f32 kernel unavailable (%s); fp32 layers keep four bytes a weight", e)
        return None
