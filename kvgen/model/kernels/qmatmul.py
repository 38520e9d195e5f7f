"""The compiled quantized matmul (qmatmul.c): when it can run, loading it, and calling it.

One source, two builds (qvec.h): AVX-512 VNNI where the CPU has it, else AVX2 with FMA and F16C
(most x86-64 CPUs since 2013), which give the same bits. Each is built with explicit flags, not
-march=native (which would also enable AMX on CPUs that advertise it, and AMX traps in some VMs),
and only loaded when /proc/cpuinfo lists every feature its flags use; elsewhere `qmatmul_kernel()`
is None and the layers dequantize and call torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library, cpu_has
from kvgen.model.kernels.bf16 import Bf16Tiles
from kvgen.model.formats.packed import PANEL as PACK_PANEL
from kvgen.model.formats.packed import PackedWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# (the build's name, its ISA flags, the /proc/cpuinfo features they need), the first that fits wins
BUILDS = (
    ("avx512-vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"),
     ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c")),
    ("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)
_P = ctypes.c_void_p
_ARGTYPES = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, ctypes.c_int32, ctypes.c_int64, _P, ctypes.c_int32,
             ctypes.c_int32]
_DEQUANTIZE_ARGTYPES = [_P, _P, _P, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int32]


class _Args(ctypes.Structure):
    """`struct qmatmul_args` of qmatmul.c: a kernel's arguments, in order."""

    _fields_ = [("x", _P), ("T", ctypes.c_int64), ("K", ctypes.c_int64), ("codes", _P), ("scale", _P), ("min", _P),
                ("offset", ctypes.c_int32), ("N", ctypes.c_int64), ("out", _P), ("parts", ctypes.c_int32),
                ("num_threads", ctypes.c_int32)]


# How x is quantized: one int8 part per span (as ggml), or two (the second quantizes the first's
# rounding error: ~15 bits, for one more row of x per token in the kernel).
ACTIVATION_PARTS = {"int8": 1, "int8x2": 2}


def quantized_activations(quantize: ctypes._CFuncPtr, x: torch.Tensor, parts: int,
                          kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [T, in] -> (q int8 [parts, T, in], scale fp32 [parts, T, in/32]) as a packed kernel
    quantizes x, by its C entry `quantize(x, T, K, parts, q, scale)`: x^ = sum over parts of
    scale * q. Each kernel keeps the quantizer in its own C source, for the layout its inner loop
    reads (qmatmul.c: spans by column block, AVX2 or AVX-512; kquant.c: rows with per-16 sums for
    Q6_K); both hand their q and scales back in this shape, the one way tests and tools read them."""
    x = x.to(torch.float32).contiguous()
    rows, cols = x.shape
    q = torch.empty(rows, parts, cols, dtype=torch.int8)
    scale = torch.empty(rows, parts, cols // 32, dtype=torch.float32)
    if quantize(x.data_ptr(), rows, cols, parts, q.data_ptr(), scale.data_ptr()):
        raise MemoryError(f"{kernel}: out of memory for the quantized activations")
    return q.transpose(0, 1), scale.transpose(0, 1)


def kernel_name(w: PackedWeight) -> str:
    """The C function for the format: qmatmul_{u{bits} or the codebook}_g{group}_{scale dtype}."""
    codes = w.codebook or f"u{w.bits}"
    return f"qmatmul_{codes}_g{w.group}_{'f16' if w.scale.dtype == torch.float16 else 'f32'}"


class QMatmulKernel:
    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self._library = library
        self.isa = isa  # which of BUILDS it is
        quantize = library.quantize_activations
        quantize.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, _P, _P]
        quantize.restype = ctypes.c_int
        self._quantize = quantize

    def bind(self, w: PackedWeight, activations: str = "int8") -> BoundKernel:
        """The kernel for `w`'s format with `w`'s pointers filled in, quantizing x as `activations`
        says (a key of ACTIVATION_PARTS); AttributeError if qmatmul.c has no such variant."""
        function = getattr(self._library, kernel_name(w))
        function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
        dequantize = {}
        for layout in ("bf16", "bf16_rows", "f32"):
            dequantize[layout] = getattr(self._library, f"{kernel_name(w)}_{layout}")
            dequantize[layout].argtypes, dequantize[layout].restype = _DEQUANTIZE_ARGTYPES, None
        call = getattr(self._library, kernel_name(w) + "_call")
        return BoundKernel(function, dequantize, call, w, ACTIVATION_PARTS[activations])

    def address(self, w: PackedWeight) -> int:
        """The address of the C kernel for `w`'s format, for C callers that run it on parts of a
        weight (moe.c, over one expert of a stack at a time)."""
        return ctypes.cast(getattr(self._library, kernel_name(w)), ctypes.c_void_p).value

    def quantize_activations(self, x: torch.Tensor, activations: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
        """x as the kernels quantize it (see `quantized_activations`)."""
        return quantized_activations(self._quantize, x, ACTIVATION_PARTS[activations], "quantized matmul")


class BoundKernel:
    """One packed weight's kernel call: only x, its row count and the output change per call."""

    def __init__(self, function: ctypes._CFuncPtr, dequantize: dict[str, ctypes._CFuncPtr],
                 call: ctypes._CFuncPtr, w: PackedWeight, parts: int) -> None:
        self._function, self._dequantize, self._call = function, dequantize, call
        self._weight, self._parts = w, parts  # w's tensors stay alive while bound
        self._out_features, self._in_features = w.shape
        minimum = 0 if w.min is None else w.min.data_ptr()
        self._weight_args = (w.codes.data_ptr(), w.scale.data_ptr(), minimum, w.offset, w.shape[0])

    def dequantize_bf16(self, tiles: Bf16Tiles | None = None) -> torch.Tensor:
        """W^ rounded to bf16 in kvgen.model.kernels.bf16's layout [ceil(out/4), in/32, 4, 32] (for
        the bf16 kernel at many rows), in `tiles`' buffer if given."""
        shape = (-(-self._out_features // 4), self._in_features // 32, 4, 32)
        return self._dequantized("bf16", shape, torch.bfloat16, tiles)

    def dequantize_bf16_rows(self, tiles: Bf16Tiles | None = None) -> torch.Tensor:
        """W^ rounded to bf16, row-major [out, in] (oneDNN's operand at many rows), in `tiles`' buffer
        if given."""
        rows = -(-self._out_features // PACK_PANEL) * PACK_PANEL  # the C function writes whole panels
        return self._dequantized("bf16_rows", (rows, self._in_features), torch.bfloat16, tiles)[:self._out_features]

    def dequantize_f32(self, tiles: Bf16Tiles | None = None) -> torch.Tensor:
        """W^ in fp32 in kvgen.model.kernels.f32's panels [ceil(out/32), in, 32] (for the fp32 kernel
        at many rows), in `tiles`' buffer if given."""
        return self._dequantized("f32", (-(-self._out_features // 32), self._in_features, 32), torch.float32, tiles)

    def _dequantized(self, layout: str, shape: tuple[int, ...], dtype: torch.dtype,
                     tiles: Bf16Tiles | None) -> torch.Tensor:
        out = tiles.take(shape, dtype) if tiles is not None else torch.empty(shape, dtype=dtype)
        self._dequantize[layout](*self._weight_args[:3], self._weight.offset, self._out_features, self._in_features,
                                 out.data_ptr(), torch.get_num_threads())
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, in], contiguous, on the CPU -> fp32 [T, out]."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self._in_features:
            raise ValueError(f"quantized matmul: x must be contiguous fp32 [T, {self._in_features}], "
                             f"not {x.dtype} {list(x.shape)}")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """__call__ for an x already known to be contiguous fp32 [T, in]: a decode step makes ~120
        calls, and the checks cost as much as the Python of the call itself."""
        rows = x.shape[0]
        out = torch.empty(rows, self._out_features, dtype=torch.float32)
        if rows and self._function(x.data_ptr(), rows, self._in_features, *self._weight_args, out.data_ptr(),
                                   self._parts, torch.get_num_threads()):
            raise MemoryError("quantized matmul: out of memory for the quantized activations")
        return out

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = `run(x)` (x fp32 [T, in], out fp32 [T, out], both contiguous) as a KernelCall."""
        assert (x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous() and x.dim() == 2
                and x.shape[0] and x.shape[1] == self._in_features and out.shape == (x.shape[0], self._out_features))
        args = _Args(x.data_ptr(), x.shape[0], self._in_features, *self._weight_args, out.data_ptr(), self._parts,
                     torch.get_num_threads())
        return KernelCall(self._call, args, keep=(x, out, self._weight))

@functools.cache
def qmatmul_kernel() -> QMatmulKernel | None:
    """The kernel, built once per machine for the first of BUILDS this CPU has, or None where it has
    none of them or the build fails (then the layers use torch)."""
    isa = next((name for name, _, features in BUILDS if cpu_has(features)), None)
    return None if isa is None else qmatmul_build(isa)


@functools.cache
def qmatmul_build(isa: str) -> QMatmulKernel | None:
    """BUILDS' `isa` build (the tests hold the builds this CPU runs to the same bits), or None where
    the CPU lacks its features or the build fails."""
    flags, features = next((flags, features) for name, flags, features in BUILDS if name == isa)
    if not cpu_has(features):
        return None
    try:
        return QMatmulKernel(ctypes.CDLL(str(build_library(SOURCE, (*COMMON_FLAGS, *flags)))), isa)
    except OSError as e:
        log.warning("quantized matmul kernel unavailable (%s); quantized layers dequantize and use torch", e)
        return None
