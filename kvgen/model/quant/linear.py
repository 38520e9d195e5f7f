"""Linear layers over weights that stay quantized in memory (kvgen.model.quant.formats).

    KernelQuantLinear CPU with AVX-512 VNNI or AVX2: the compiled kernel (qmatmul.c, the same bits
                      from either build); x is quantized inside the call, per group of 32: to int8
                      (`activations="int8"`, as ggml), or to two int8 parts, the second quantizing
                      the first's rounding error (`"int8x2"`, ~15 bits; on the real Q4_1 file top-1
                      agreement with the fp32 model is 97.8-98.2% with int8 and 100% with int8x2, see
                      BENCHMARKS.md). Against fp32 BLAS on the dequantized weights it is faster at
                      1, 16 and 64 rows and no slower at 512. From `many_rows.from_rows` rows on
                      (prefill), where the CPU has AVX-512 BF16, the weight is instead dequantized
                      per call to bf16 (qmatmul.c, in C) and x runs in bf16 through
                      kvgen.model.kernels.bf16: there the integer kernel is compute-bound and its
                      two parts of x cost it twice the work, while bf16 dot products do 32
                      multiply-adds an instruction (top-1 agreement with the fp32 model on the real
                      Q4_1 file: 99.2%; BENCHMARKS.md). Where the CPU has no AVX-512 BF16 but the
                      fp32 kernel runs (AVX2), from FP32_FROM_ROWS rows on the weight is dequantized
                      to fp32 per call and x runs through kvgen.model.kernels.f32 instead: exact
                      weights, fp32 sums.
    TorchQuantLinear  CUDA and other devices: dequantizes on each call and runs F.linear, so the
                      weights stay packed in memory; also the kernel's CPU twin in the tests.

A CPU with neither gets the float layer of kvgen.model.linear on the dequantized weights (exact
values, fp32 bytes): dequantizing every matrix on every call would cost more than the step.

`describe(layer)` says which kernel a layer runs and how many bytes its weights take, for the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvgen.model.kernels import KernelCall
from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.f32 import pack as pack_f32
from kvgen.model.linear import Linear, RowKernels, make_linear
from kvgen.model.quant.float_weights import quantize_int4, quantize_int8
from kvgen.model.quant.formats import PackedWeight, dequantize
from kvgen.model.quant.gguf_blocks import convert
from kvgen.model.quant.kernel import ACTIVATION_PARTS, kernel_name, qmatmul_kernel

CPU = torch.device("cpu")
FLOAT_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
# Without the bf16 kernel, from this many rows of x on a packed layer dequantizes its weight to fp32
# per call and runs the fp32 kernel on it. A 3,072 x 576 int4 matrix at 64 / 128 / 512 rows took
# 9.8 / 20.5 / 81.9 ms on the integer kernel (x int8x2) and 10.1 / 11.4 / 16.1 ms dequantized,
# packed and multiplied (AVX2 build, 2 threads, Zen 3; BENCHMARKS.md).
FP32_FROM_ROWS = 128


class QuantLinear(Linear):
    """y = x @ W^T + bias for a PackedWeight W (on the device the layer runs on)."""

    kernel: str

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        # Linear.__init__ reads the shape from a dense weight, which this layer never builds.
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = weight

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes


@dataclass(frozen=True)
class ManyRows:
    """From `from_rows` rows of x on, a packed layer runs in bf16 (see KernelQuantLinear), dequantizing
    its weight into `tiles`; where the CPU has no bf16 kernel, from FP32_FROM_ROWS in fp32."""

    from_rows: int
    tiles: Bf16Tiles


class KernelQuantLinear(QuantLinear):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, activations: str = "int8",
                 many_rows: ManyRows | None = None) -> None:
        super().__init__(weight, bias)
        kernel = qmatmul_kernel()
        assert kernel is not None, "KernelQuantLinear needs the compiled kernel (see qmatmul_kernel())"
        self._matmul = kernel.bind(weight, activations)
        self._bf16 = bf16_kernel() if many_rows is not None else None
        self._f32 = f32_kernel() if many_rows is not None and self._bf16 is None else None
        self._tiles = many_rows.tiles if self._bf16 is not None else None
        self._from_rows = (many_rows.from_rows if self._bf16 is not None
                           else FP32_FROM_ROWS if self._f32 is not None else None)
        path = "bf16_matmul" if self._bf16 is not None else "f32_matmul"
        many = f"; from {self._from_rows} rows {path}" if self._from_rows is not None else ""
        self.kernel = f"{kernel_name(weight)} [{kernel.isa}] (x {activations}{many})"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype. `rows` needs nothing: each row's result is the same
        whatever rows run with it, for a given side of the many-rows threshold."""
        if self._many_rows(x):
            out = self._dequantized_matmul(x)
        elif x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == self.in_features:
            out = self._matmul.run(x)
        else:
            out = self._matmul(x.float().contiguous())
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """The integer kernel's call, which is what `self(x)` runs for fp32 x below the many-rows
        threshold."""
        if self.bias is not None or x.dtype != torch.float32 or self._many_rows(x):
            return None
        return self._matmul.call(x, out)

    def _many_rows(self, x: torch.Tensor) -> bool:
        """Whether x has enough rows to run on the dequantized weight (see ManyRows)."""
        return self._from_rows is not None and x.shape[0] >= self._from_rows

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W^T -> fp32 [T, out]: in bf16 on W^ rounded to bf16 where the bf16 kernel runs,
        else in fp32 on W^."""
        if self._bf16 is not None:
            tiles = self._matmul.dequantize_bf16(self._tiles)
            return self._bf16(x.to(torch.bfloat16).contiguous(), tiles, self.out_features, torch.float32)
        return self._f32(x.float().contiguous(), pack_f32(dequantize(self.packed)), self.out_features)


class TorchQuantLinear(QuantLinear):
    kernel = "torch-dequantize"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        weight = dequantize(self.packed).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


def packed_linear(weight: PackedWeight, bias: torch.Tensor | None = None, device: torch.device = CPU,
                  dtype: torch.dtype = torch.float32, activations: str = "int8",
                  many_rows: ManyRows | None = None) -> Linear:
    """The layer for a packed weight on `device` (see the module docstring). `dtype` is the float
    layer's where a CPU lacks the kernel's features; `activations` how the kernel quantizes x;
    `many_rows` (None: never) from how many rows of x on, where the CPU has AVX-512 BF16, the weight
    is dequantized to bf16 per call and x runs in bf16; without it, from FP32_FROM_ROWS in fp32 (see
    KernelQuantLinear)."""
    if activations not in ACTIVATION_PARTS:
        raise ValueError(f"activations {activations!r}: expected one of {', '.join(ACTIVATION_PARTS)}")
    if device.type != "cpu":
        return TorchQuantLinear(weight.to(device), None if bias is None else bias.to(device))
    if qmatmul_kernel() is not None:
        return KernelQuantLinear(weight, bias, activations, many_rows)
    return make_linear(dequantize(weight).to(dtype), bias)


def describe(layer: Linear) -> tuple[str, int]:
    """(kernel name, weight bytes) of any kvgen layer: a quantized layer's kernel, or the float
    layer's class, and the bytes its weight takes as held."""
    return (layer.kernel if isinstance(layer, QuantLinear) else type(layer).__name__), layer.weight_bytes


def make_quantized_linear(ggml_type: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int],
                          bias: torch.Tensor | None = None, device: torch.device = CPU,
                          dtype: torch.dtype = torch.float32, activations: str = "int8") -> Linear:
    """A GGUF matrix (raw blocks uint8 [out, bytes per row], `shape` (out, in)) as a layer that keeps
    its values quantized; a type no kernel format holds (see kvgen.model.quant) is dequantized with
    gguf to `dtype` and gets the float layer of kvgen.model.linear."""
    packed = convert(ggml_type, raw, shape)
    if packed is not None:
        return packed_linear(packed, bias, device, dtype, activations)
    weight = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, ggml_type).reshape(shape)))
    return make_linear(weight.to(device, dtype), bias)


def quantize_linear(weight: torch.Tensor, method: str, bias: torch.Tensor | None = None,
                    activations: str = "int8", many_rows: ManyRows | None = None) -> Linear:
    """A float weight [out, in] quantized by `method` ("int8" or "int4", see float_weights), on its
    device."""
    if method not in FLOAT_QUANTIZERS:
        raise ValueError(f"quantization {method!r}: expected one of {', '.join(FLOAT_QUANTIZERS)}")
    return packed_linear(FLOAT_QUANTIZERS[method](weight), bias, weight.device, weight.dtype, activations,
                         many_rows)
