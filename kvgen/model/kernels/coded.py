"""fp32 and bf16 weights coded losslessly in fewer bytes, and the kernels that read them
(f32_coded.c, bf16_coded.c; the layouts' shared part is kvgen.model.formats.coded).

A decode step reads every weight once, at the memory's speed, so a float model decodes no faster than
its bytes allow. A float's top byte (sign and 7 exponent bits) takes few values in a trained matrix:
each weight keeps its other bytes and a 4-bit code from a 16-entry table, the few outside the table
listed apart and added after their row's sum.

    fp32  28 bits a weight: the low 3 bytes and the code, in f32_matmul.c's panels of 32 output
          features (AVX-512 VBMI). An eighth fewer bytes, the same fp32 values; every output is
          still one chain of fused multiply-adds, whatever the row count.
    bf16  12 bits a weight: the low byte and the code, in tiles of 4 rows (AVX-512 BF16). A quarter
          fewer bytes, the same bf16 values; the sums equal the bf16 kernel's bit for bit where a
          tile has no outlier, within the same fp32 rounding bound where it has.

Two C sources, since each is built with its own ISA flags and loads only where the CPU has them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.model.formats.coded import CodedArgs, CodedWeight, OutliersStruct, encode
from kvgen.model.kernels.bf16 import CPU_FEATURES as BF16_FEATURES
from kvgen.model.kernels.bf16 import FLAGS as BF16_FLAGS
from kvgen.model.kernels.bf16 import Bf16Tiles
from kvgen.model.kernels.build import KernelCall, build_library, cpu_has
from kvgen.model.kernels.f32 import COMMON_FLAGS, PANEL

log = logging.getLogger(__name__)

F32_SOURCE = Path(__file__).with_name("f32_coded.c")
F32_FLAGS = (*COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vbmi")
F32_FEATURES = ("avx512f", "avx512bw", "avx512vbmi")
STEP_BYTES = 112  # an fp32 panel's k step: 32 weights' low 3 bytes, then 16 code bytes
_PACK_PANELS = 256  # fp32 panels laid out at a time: bounds the int32 intermediates of a large LM head
BF16_SOURCE = Path(__file__).with_name("bf16_coded.c")
TILE_ROWS, SPAN = 4, 64  # a bf16 tile's span: 4 rows x (64 low bytes + 32 code bytes), 384 bytes
# The column stored at byte p of a bf16 row's span: vpunpck{l,h}bw interleave within 128-bit lanes,
# so byte 16j + i (i < 8) becomes word 8j + i of columns 0-31, byte 16j + 8 + i word 8j + i of 32-63.
COLUMN_AT = torch.tensor([8 * (p // 16) + p % 8 + 32 * (p % 16 >= 8) for p in range(SPAN)])
_PACK_ROWS = 8192  # bf16 rows laid out at a time: bounds the int32 intermediates of a large LM head
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def pack_f32(weight: torch.Tensor) -> CodedWeight:
    """fp32 [N, K] -> its coded layout (f32_coded.c's header: panels [ceil(N/32), K, 112]), once at
    load."""
    n, k = weight.shape
    weight = F.pad(weight.float(), (0, 0, 0, -n % PANEL)).contiguous()
    chunks = weight.view(torch.int32).split(_PACK_PANELS * PANEL)  # [rows, K]
    return encode(chunks, 24, PANEL, _f32_layout, weight, (n, k))


def _f32_layout(codes: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Codes and low 3 bytes [rows, K] (rows a multiple of 32) -> panels uint8 [rows/32, K, 112]."""
    rows, k = codes.shape
    panels = rows // PANEL
    low_bytes = low.contiguous().view(torch.uint8).view(panels, PANEL, k, 4)[..., :3]  # little-endian bytes 0-2
    low_bytes = low_bytes.transpose(1, 2).reshape(panels, k, 3 * PANEL)  # [panels, K, 96]
    codes = codes.to(torch.uint8).view(panels, PANEL, k).transpose(1, 2)  # [panels, K, 32]
    nibbles = codes[..., :16] | codes[..., 16:] << 4  # [panels, K, 16]
    return torch.cat([low_bytes, nibbles], dim=2)


class _CodedMatmul:
    """What the two coded kernels share: the matmul call over `CodedArgs`, and its checks. A kernel
    takes x in `x_dtype` and writes out in one of `out_dtypes`."""

    name: str
    x_dtype: torch.dtype
    out_dtypes: tuple[torch.dtype, ...]

    def call(self, x: torch.Tensor, packed: CodedWeight, out: torch.Tensor) -> KernelCall:
        """out = x @ W^T (out [T, n] contiguous) as a KernelCall."""
        assert x.shape[0] and out.is_contiguous() and out.shape[0] == x.shape[0]
        return KernelCall(self._call, self._args(x, packed, out), keep=(x, packed, out))

    @staticmethod
    def packed_bytes(packed: CodedWeight) -> int:
        return packed.nbytes

    def _args(self, x: torch.Tensor, packed: CodedWeight, out: torch.Tensor) -> CodedArgs:
        if x.dtype != self.x_dtype or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"{self.name} matmul: x must be contiguous {self.x_dtype} [T, K], "
                             f"not {x.dtype} {list(x.shape)}")
        if packed.shape != (out.shape[1], x.shape[1]):
            raise ValueError(f"{self.name} matmul: x [{x.shape[1]} columns] does not fit the packed weight "
                             f"{packed.shape}")
        if out.dtype not in self.out_dtypes:
            raise ValueError(f"{self.name} matmul: out must be one of {self.out_dtypes}, not {out.dtype}")
        return CodedArgs.of(x, packed, out)


class CodedF32Matmul(_CodedMatmul):
    """The kernel, with the fp32 kernel's interface (kvgen.model.kernels.f32.F32Matmul) on a coded
    weight (its codes: panels [ceil(N/32), K, 112])."""

    pack = staticmethod(pack_f32)
    name, x_dtype, out_dtypes = "f32", torch.float32, (torch.float32,)

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

    def rows(self, packed: CodedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight -> fp32 [T, K] (a tied embedding's lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], packed.shape[1])
        self._rows(*packed.pointers(), packed.shape[1], ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out



@functools.cache
def coded_f32_kernel() -> CodedF32Matmul | None:
    """The kernel, built once per machine, or None where this CPU lacks its features (AVX-512 VBMI)
    or it cannot be built."""
    if not cpu_has(F32_FEATURES):
        return None
    try:
        return CodedF32Matmul(ctypes.CDLL(str(build_library(F32_SOURCE, F32_FLAGS))))
    except OSError as e:
        log.warning("coded f32 kernel unavailable (%s); fp32 layers keep four bytes a weight", e)
        return None


def fits(weight: torch.Tensor) -> bool:
    """Whether the coded layout holds this matrix: rows of whole 64-column spans."""
    return weight.dim() == 2 and weight.shape[1] % SPAN == 0


def pack_bf16(weight: torch.Tensor) -> CodedWeight:
    """bf16 [N, K] (K a multiple of 64) -> its coded layout (bf16_coded.c's header), once at load."""
    n, k = weight.shape
    assert k % SPAN == 0, "the coded layout takes whole spans of 64 columns"
    weight = F.pad(weight.to(torch.bfloat16), (0, 0, 0, -n % TILE_ROWS))
    chunks = [c.to(torch.int32) & 0xFFFF for c in weight.view(torch.int16).split(_PACK_ROWS)]  # [rows, K]
    return encode(chunks, 8, TILE_ROWS, _bf16_layout, weight, (n, k))


def _bf16_layout(codes: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Codes and low bytes [rows, K] (rows a multiple of 4) -> tiles uint8 [rows/4, K/64, 384]."""
    rows, k = codes.shape
    codes, low = (t.to(torch.uint8).view(rows // TILE_ROWS, TILE_ROWS, k // SPAN, SPAN)[..., COLUMN_AT].transpose(1, 2)
                  for t in (codes, low))  # [tiles, spans, 4, 64], each a byte
    nibbles = codes[..., :32] | codes[..., 32:] << 4  # [tiles, spans, 4, 32]
    return torch.cat([low.flatten(2), nibbles.flatten(2)], dim=2)


class CodedBf16Matmul(_CodedMatmul):
    """The kernel, with the bf16 kernel's interface (kvgen.model.kernels.bf16.Bf16Matmul) on a coded
    weight (its codes: tiles [ceil(N/4), K/64, 384])."""

    pack = staticmethod(pack_bf16)
    name, x_dtype, out_dtypes = "bf16", torch.bfloat16, (torch.bfloat16, torch.float32)

    def __init__(self, library: ctypes.CDLL) -> None:
        self._call = library.bf16_coded_matmul_call
        self._call.argtypes, self._call.restype = [ctypes.POINTER(CodedArgs)], ctypes.c_int
        self._decode_into = library.bf16_coded_decode
        self._decode_into.argtypes = [_P, _P, OutliersStruct, _I64, _I64, _P, ctypes.c_int32, ctypes.c_int32]
        self._decode_into.restype = None
        self._decode_f32 = library.bf16_coded_decode_f32
        self._decode_f32.argtypes = [_P, _P, OutliersStruct, _I64, _I64, _P, ctypes.c_int32]
        self._decode_f32.restype = None

    def __call__(self, x: torch.Tensor, packed: CodedWeight, out_features: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x bf16 [T, K] contiguous -> [T, out_features] in `out_dtype` (bf16, or float32 sums)."""
        out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
        if x.shape[0]:
            self._call(ctypes.byref(self._args(x, packed, out)))
        return out

    def unpack(self, packed: CodedWeight, out_features: int, in_features: int, tiles: Bf16Tiles) -> torch.Tensor:
        """`packed` decoded to row-major bf16 [out_features, in_features], in `tiles`' buffer (for
        oneDNN's GEMM)."""
        assert packed.shape == (out_features, in_features)
        return self._decode(packed, tiles.take(packed.shape), tiles_bf16_layout=False)

    def decode_tiles(self, packed: CodedWeight, tiles: Bf16Tiles) -> torch.Tensor:
        """`packed` decoded to the bf16 kernel's tiles [ceil(N/4), K/32, 4, 32] (kernels/bf16.py), in
        `tiles`' buffer."""
        n, k = packed.shape
        return self._decode(packed, tiles.take((-(-n // TILE_ROWS), k // 32, TILE_ROWS, 32)), tiles_bf16_layout=True)

    def decode_f32_panels(self, packed: CodedWeight, tiles: Bf16Tiles) -> torch.Tensor:
        """`packed` decoded to fp32 in the fp32 kernel's panels [ceil(N/32), K, 32] (kernels/f32.py),
        in `tiles`' buffer."""
        n, k = packed.shape
        out = tiles.take((-(-n // 32), k, 32), torch.float32)
        self._decode_f32(*packed.pointers(), n, k, out.data_ptr(), torch.get_num_threads())
        return out

    def _decode(self, packed: CodedWeight, out: torch.Tensor, tiles_bf16_layout: bool) -> torch.Tensor:
        self._decode_into(*packed.pointers(), *packed.shape, out.data_ptr(), tiles_bf16_layout, torch.get_num_threads())
        return out


@functools.cache
def coded_bf16_kernel() -> CodedBf16Matmul | None:
    """The kernel, built once per machine, or None where this CPU lacks its features or it cannot be
    built."""
    if not cpu_has(BF16_FEATURES):
        return None
    try:
        return CodedBf16Matmul(ctypes.CDLL(str(build_library(BF16_SOURCE, BF16_FLAGS))))
    except OSError as e:
        log.warning("coded bf16 kernel unavailable (%s); bf16 layers keep two bytes a weight", e)
        return None
