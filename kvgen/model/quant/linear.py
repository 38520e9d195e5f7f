"""Linear layers over weights that stay quantized in memory (kvgen.model.quant.formats).

    KernelQuantLinear CPU with AVX-512 VNNI or AVX2: the compiled kernel (qmatmul.c, the same bits
                      from either build); x is quantized inside the call, per group of 32: to int8
                      (`activations="int8"`, as ggml), or to two int8 parts, the second quantizing
                      the first's rounding error (`"int8x2"`, ~15 bits; on the real Q4_1 file top-1
                      agreement with the fp32 model is 97.8-98.2% with int8 and 100% with int8x2, see
                      BENCHMARKS.md). Against fp32 BLAS on the dequantized weights it is faster at
                      1, 16 and 64 rows and no slower at 512. At many rows (prefill) the integer
                      kernel is compute-bound and its two parts of x cost it twice the work, so from
                      BF16_FROM_ROWS / FP32_FROM_ROWS rows on the weight is instead dequantized per
                      call (in C, qmatmul.c) and x runs through a float kernel: in bf16
                      (kvgen.model.kernels.bf16: 32 multiply-adds an instruction; top-1 agreement
                      with the fp32 model on the real Q4_1 file: 99.2%, BENCHMARKS.md) or in fp32
                      (kvgen.model.kernels.f32: exact weights, fp32 sums), whichever many_rows_dtype
                      finds faster on this CPU; only the fp32 one on CPUs without AVX-512 BF16.
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
from kvgen.model.kernels.faster import many_rows_dtype
from kvgen.model.linear import Linear, RowKernels, make_linear
from kvgen.model.quant.float_weights import quantize_int4, quantize_int8
from kvgen.model.quant.formats import PackedWeight, dequantize
from kvgen.model.quant.gguf_blocks import convert
from kvgen.model.quant.kernel import ACTIVATION_PARTS, kernel_name, qmatmul_kernel

CPU = torch.device("cpu")
FLOAT_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
# From this many rows of x on (prefill chunks, large decode batches) a packed layer runs on its
# weight dequantized per call, in bf16 or fp32 (see KernelQuantLinear). bf16: 1.3-1.9x faster than
# the integer kernel at 16 rows, 2.5-3.4x at 64-512, and slower below ~8 (BENCHMARKS.md).
BF16_FROM_ROWS = 16
# fp32, by the integer kernel's build: a 3,072 x 576 int4 matrix at 64 / 128 / 512 rows took 9.8 /
# 20.5 / 81.9 ms on the AVX2 integer kernel (x int8x2) and 10.1 / 11.4 / 16.1 ms dequantized, packed
# and multiplied (2 threads, Zen 3); on AVX-512 (2026-12-02 afternoon VM) 0.51 / 0.91 / 1.92 ms at 16
# / 32 / 64 rows against 0.88 / 0.93 / 1.35 (BENCHMARKS.md).
FP32_FROM_ROWS = {"avx512-vnni": 32, "avx2": 128}


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
    """How a packed layer runs many rows of x (see KernelQuantLinear): on its weight dequantized per
    call into `tiles` (a buffer the model's layers share), in `dtype` (bf16 or fp32; None: this CPU's
    faster, kvgen.model.kernels.faster)."""

    tiles: Bf16Tiles
    dtype: torch.dtype | None = None


class KernelQuantLinear(QuantLinear):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, activations: str = "int8",
                 many_rows: ManyRows | None = None) -> None:
        super().__init__(weight, bias)
        kernel = qmatmul_kernel()
        assert kernel is not None, "KernelQuantLinear needs the compiled kernel (see qmatmul_kernel())"
        self._matmul = kernel.bind(weight, activations)
        dtype = many_rows_dtype(many_rows.dtype) if many_rows is not None else None
        self._bf16 = bf16_kernel() if dtype == torch.bfloat16 else None
        self._f32 = f32_kernel() if dtype == torch.float32 else None
        self._tiles = many_rows.tiles if dtype is not None else None
        self._from_rows = (None if dtype is None else BF16_FROM_ROWS if dtype == torch.bfloat16
                           else FP32_FROM_ROWS[kernel.isa])
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
        return self._f32(x.float().contiguous(), self._matmul.dequantize_f32(self._tiles), self.out_features)


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
    `many_rows` (None: never) how many rows of x run on the weight dequantized per call (ManyRows)."""
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
