"""The compiled K-quant matmul (kquant.c) and its packer (kquant_pack.c): when they can run, loading
them, and calling them.

Two builds, as qmatmul's (kvgen.model.kernels.qmatmul.BUILDS): AVX-512 VNNI where the CPU has it,
else AVX2 with FMA and F16C, which give the same bits. Each is built with explicit flags (not
-march=native, which would also enable AMX where a CPU advertises it) and loaded only where
/proc/cpuinfo lists every feature it uses; elsewhere `kquant_kernel()` is None and K-quant matrices
take the generic packed format (kvgen.model.formats.packed), which widens them to 6-10 bits a weight.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvgen.model.kernels.build import KernelCall, build_library, cpu_has
from kvgen.model.kernels.bf16 import Bf16Tiles
from kvgen.model.kernels.block_pack import row_pointers
from kvgen.model.kernels.qmatmul import BUILDS, COMMON_FLAGS, quantized_activations
from kvgen.model.formats.kquant import KINDS, PANEL, QK_K, KPacked, block_bytes

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kquant.c")
PACK_SOURCE = Path(__file__).with_name("kquant_pack.c")
_P = ctypes.c_void_p
_ARGTYPES = [_P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int64, _P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]


class _Args(ctypes.Structure):
    """`struct kq_args` of kquant.c, in order."""

    _fields_ = [("x", _P), ("T", ctypes.c_int64), ("K", ctypes.c_int64), ("w", _P), ("N", ctypes.c_int64),
                ("out", _P), ("ldo", ctypes.c_int64), ("parts", ctypes.c_int32), ("num_threads", ctypes.c_int32)]


class KQuantKernel:
    def __init__(self, library: ctypes.CDLL, packer: ctypes.CDLL, isa: str) -> None:
        self._library, self.isa = library, isa
        quantize = library.kq_quantize
        quantize.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, _P, _P]
        quantize.restype = ctypes.c_int
        self._quantize = quantize
        self._packers = {}
        for ggml_type, kind in KINDS.items():
            pack = getattr(packer, f"kq_pack_{kind}")
            pack.argtypes, pack.restype = [_P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int32], None
            self._packers[ggml_type] = pack

    def pack(self, ggml_type: GGMLQuantizationType, parts: Sequence[np.ndarray]) -> KPacked:
        """Q4_K/Q5_K/Q6_K matrices' blocks (each uint8 [rows, bytes per row], rows of the same width;
        views of the file's memory map are read in place) stacked by rows -> KPacked, in one pass
        (kquant_pack.c). A part's rows may be any row-strided view, such as a permutation's copy."""
        rows, cols = row_pointers(ggml_type, parts, KINDS, "K-quant")
        out = torch.empty(-(-len(rows) // PANEL), cols // QK_K * block_bytes(ggml_type), dtype=torch.uint8)
        self._packers[ggml_type](rows.ctypes.data, len(rows), cols, out.data_ptr(), torch.get_num_threads())
        return KPacked(out, ggml_type, (len(rows), cols))

    def bind(self, w: KPacked, parts: int) -> BoundKQuant:
        """The kernel for `w`'s type with its pointer filled in, x quantized in `parts` int8 parts."""
        function = getattr(self._library, f"kq_matmul_{w.kind}")
        function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
        dequantize = getattr(self._library, f"kq_dequantize_bf16_{w.kind}")
        dequantize.argtypes, dequantize.restype = [_P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int32], None
        return BoundKQuant(function, getattr(self._library, f"kq_matmul_{w.kind}_call"), dequantize, w, parts)

    def address(self, w: KPacked) -> int:
        """The address of the C kernel for `w`'s type, for C callers that run it on parts of a weight
        (moe.c, over one expert of a stack at a time)."""
        return ctypes.cast(getattr(self._library, f"kq_matmul_{w.kind}"), ctypes.c_void_p).value

    def rows(self, w: KPacked, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (int64 [n]) of w's values, fp32 [n, in]: kquant_format.dequantize_rows's
        values, in C (a prompt's embedding lookups)."""
        rows = rows.to(torch.int64).contiguous()
        out = torch.empty(len(rows), w.shape[1], dtype=torch.float32)
        function = getattr(self._library, f"kq_rows_{w.kind}")
        function.argtypes, function.restype = [_P, ctypes.c_int64, _P, ctypes.c_int64, _P], None
        function(w.data.data_ptr(), w.shape[1], rows.data_ptr(), len(rows), out.data_ptr())
        return out

    def quantize_activations(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x as the kernel quantizes it (see kvgen.model.kernels.qmatmul.quantized_activations)."""
        return quantized_activations(self._quantize, x, parts, "K-quant matmul")


class BoundKQuant:
    """One K-quant weight's kernel call: only x, its row count and the output change per call."""

    def __init__(self, function: ctypes._CFuncPtr, call: ctypes._CFuncPtr, dequantize: ctypes._CFuncPtr, w: KPacked,
                 parts: int) -> None:
        self._function, self._call, self._dequantize, self._weight, self._parts = function, call, dequantize, w, parts
        self._out_features, self._in_features = w.shape

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, in], contiguous -> fp32 [T, out]."""
        rows = x.shape[0]
        out = torch.empty(rows, self._out_features, dtype=torch.float32)
        if rows and self._function(x.data_ptr(), rows, self._in_features, self._weight.data.data_ptr(),
                                   self._out_features, out.data_ptr(), self._out_features, self._parts,
                                   torch.get_num_threads()):
            raise MemoryError("K-quant matmul: out of memory for the quantized activations")
        return out

    def dequantize_bf16_rows(self, tiles: Bf16Tiles | None = None) -> torch.Tensor:
        """W^ rounded to bf16, row-major [out, in] (oneDNN's operand at many rows), in `tiles`' buffer
        if given."""
        shape = (-(-self._out_features // PANEL) * PANEL, self._in_features)  # whole panels are written
        out = tiles.take(shape) if tiles is not None else torch.empty(shape, dtype=torch.bfloat16)
        self._dequantize(self._weight.data.data_ptr(), self._in_features, self._out_features, out.data_ptr(),
                         torch.get_num_threads())
        return out[:self._out_features]

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = `run(x)` (x fp32 [T, in] contiguous, out fp32 [T, out] with contiguous rows: it may be
        a column slice of a wider buffer) as a KernelCall."""
        assert (x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1 and x.dim() == 2
                and x.shape[0] and x.shape[1] == self._in_features and out.shape == (x.shape[0], self._out_features))
        args = _Args(x.data_ptr(), x.shape[0], self._in_features, self._weight.data.data_ptr(), self._out_features,
                     out.data_ptr(), out.stride(0), self._parts, torch.get_num_threads())
        return KernelCall(self._call, args, keep=(x, out, self._weight))


@functools.cache
def kquant_kernel() -> KQuantKernel | None:
    """The kernel and its packer, built once per machine for the first of BUILDS this CPU has, or
    None where it has none of them or a build fails (then K-quant matrices take the generic packed
    format)."""
    isa = next((name for name, _, features in BUILDS if cpu_has(features)), None)
    return None if isa is None else kquant_build(isa)


@functools.cache
def kquant_build(isa: str, source: Path = SOURCE) -> KQuantKernel | None:
    """The kernel and its packer as BUILDS' `isa` build (the tests hold the builds this CPU runs to
    the same bits), or None where the CPU lacks its features or the build fails. `source`: another
    kquant.c of the same packed layout, beside the headers it includes (a benchmark's baseline)."""
    flags, features = next((flags, features) for name, flags, features in BUILDS if name == isa)
    if not cpu_has(features):
        return None
    try:
        library, packer = (ctypes.CDLL(str(build_library(path, (*COMMON_FLAGS, *flags))))
                           for path in (source, PACK_SOURCE))
        return KQuantKernel(library, packer, isa)
    except OSError as e:
        log.warning("K-quant kernel unavailable (%s); K-quant matrices use the generic packed format", e)
        return None
