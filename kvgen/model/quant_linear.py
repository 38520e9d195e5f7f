"""Linear layers over weights that stay quantized in memory (kvgen.model.formats), their kernel chosen
once, when the weights load (kvgen.model.linear_choice):

    KernelQuantLinear  the generic packed format, AVX-512 VNNI or AVX2 (qmatmul.c); x quantized in
                  the call per 32, to int8 or two int8 parts (`int8x2`, ~15 bits: 100% top-1 against
                  the fp32 model on the real Q4_1 file, 97.8-98.2% for int8). From BF16_FROM_ROWS /
                  FP32_FROM_ROWS rows (prefill, compute-bound) the weight is dequantized per call for
                  the float kernel this CPU runs faster (kernels/many_rows_choice.py), unless the
                  integer kernel measures clearly faster there too (float_from_rows), and from
                  ONEDNN_FROM_ROWS rows to row-major bf16 for oneDNN's GEMM where that measured
                  faster still (AMX hosts; docs/kernels.md).
    KQuantLinear  Q4_K / Q5_K / Q6_K in kquant.c's layout (AVX-512 VNNI or AVX2), one kernel at every row
                  count; x in one int8 part from MANY_ROWS rows, where a second would double its work;
                  from ONEDNN_FROM_ROWS rows on oneDNN's GEMM where that measured faster.
    TorchQuantLinear  CUDA and other devices: dequantize per call, then `F.linear`.
    ConcatLinear  layers over one input side by side (a Q4_K q/k beside a Q6_K v).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.model.formats.kquant import KPacked
from kvgen.model.formats.packed import PackedWeight, dequantize
from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.kquant import kquant_kernel
from kvgen.model.kernels.many_rows_choice import (INTEGER_BELOW_ROWS, PREFILL_MARGIN, PREFILL_ROWS,
                                                  integer_beats, many_rows_dtype, onednn_beats)
from kvgen.model.kernels.qmatmul import ACTIVATION_PARTS, kernel_name, qmatmul_kernel
from kvgen.model.kernels.step import step_kernels
from kvgen.model.linear import ONEDNN_FROM_ROWS, Linear, RowKernels, has_onednn_bf16, onednn_matmul

# From this many rows of x on (prefill chunks, large decode batches; INTEGER_BELOW_ROWS where that
# measures faster) a packed layer runs on its weight dequantized per call, in bf16 or fp32
# (KernelQuantLinear). bf16: 1.3-1.9x faster than x int8x2 at 16 rows on some VMs (BENCHMARKS.md).
BF16_FROM_ROWS = 16
# fp32, by the integer kernel's build and the codes' bits: on an AVX-512 VM an int4 matrix took 0.51 / 0.91 /
# 1.92 ms at 16 / 32 / 64 rows against 0.88 / 0.93 / 1.35 dequantized, packed and multiplied (BENCHMARKS.md).
# On an AMD EPYC without AVX-512 (2 threads), since the AVX2 build's int16 sums stay in registers
# (qvec.h's dot4_rows), x int8x2 through 4-bit codes is ahead up to a 512-row prefill chunk: 3,072 x 576 /
# 8,960 x 1,536 took 2.9 / 22.7 ms at 128 rows and 12.7 / 112 at 512 against 5.0 / 45.9 and 12.6 / 117
# dequantized; 8-bit codes, which AVX2 widens a product at a time, are behind from 128 rows (6.1 / 37.6
# against 3.5 / 47.9, and 20.4 / 170 against 12.4 / 114 at 512).
FP32_FROM_ROWS = {("avx512-vnni", 4): 32, ("avx512-vnni", 8): 32, ("avx2", 4): 512, ("avx2", 8): 128}
# From this many rows of x on, one int8 part (KQuantLinear); fused decode steps run below 16 rows
# (kvgen.model.fused), so decode and verify chunks keep the layer's activations.
MANY_ROWS = 16


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
    faster, kvgen.model.kernels.many_rows_choice); `onednn`: from ONEDNN_FROM_ROWS rows on oneDNN's
    GEMM where that measures faster (its sums come back rounded to bf16: not for logits)."""

    tiles: Bf16Tiles
    dtype: torch.dtype | None = None
    onednn: bool = True


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
        self._from_rows = float_from_rows(dtype, kernel.isa, weight.bits, activations)
        path = ("bf16_matmul" if self._bf16 is not None else "f32_matmul") if self._from_rows else "integer_matmul"
        self._onednn = (dtype is not None and many_rows.onednn and has_onednn_bf16()
                        and onednn_beats(path.replace("_matmul", " kernel")))
        many = f"; from {self._from_rows} rows {path}" if self._from_rows is not None else ""
        many += f"; from {ONEDNN_FROM_ROWS} onednn" if self._onednn else ""
        self.kernel = f"{kernel_name(weight)} [{kernel.isa}] (x {activations}{many})"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype. `rows` needs nothing: each row's result is the same
        whatever rows run with it, for a given side of each threshold (the float path's and oneDNN's)."""
        path = self._path(x.shape[0])
        if path == "onednn":
            out = onednn_matmul(x, self._matmul.dequantize_bf16_rows(self._tiles))
        elif path == "float":
            out = self._dequantized_matmul(x)
        elif x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == self.in_features:
            out = self._matmul.run(x)
        else:
            out = self._matmul(x.float().contiguous())
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def matmul_call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """The integer kernel's call, which is what `self(x)` runs for fp32 x below the float path's
        and oneDNN's thresholds."""
        if x.dtype != torch.float32 or self._path(x.shape[0]) != "integer":
            return None
        return self._matmul.call(x, out)

    def _path(self, rows: int) -> str:
        """Which path a call of `rows` rows takes: "onednn", "float" (the weight dequantized for the
        float kernel) or "integer"."""
        if self._onednn and rows >= ONEDNN_FROM_ROWS:
            return "onednn"
        return "float" if self._from_rows is not None and rows >= self._from_rows else "integer"

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W^T -> fp32 [T, out]: in bf16 on W^ rounded to bf16 where the bf16 kernel
        runs, else in fp32 on W^."""
        if self._bf16 is not None:
            tiles = self._matmul.dequantize_bf16(self._tiles)
            return self._bf16(x.to(torch.bfloat16).contiguous(), tiles, self.out_features, torch.float32)
        return self._f32(x.float().contiguous(), self._matmul.dequantize_f32(self._tiles), self.out_features)


def float_from_rows(dtype: torch.dtype | None, isa: str, bits: int, activations: str) -> int | None:
    """From how many rows a packed layer runs on its weight dequantized for the `dtype` kernel: None
    where there is no float kernel, or where the integer kernel with the layer's activations measures
    PREFILL_MARGIN faster even at a prefill chunk's rows (many_rows_choice.PREFILL_ROWS); else the
    dtype's threshold, raised to INTEGER_BELOW_ROWS where the integer kernel measures faster at
    INTEGER_ROWS."""
    if dtype is None or integer_beats(dtype, PREFILL_ROWS, activations, PREFILL_MARGIN):
        return None
    first = BF16_FROM_ROWS if dtype == torch.bfloat16 else FP32_FROM_ROWS[isa, bits]
    return max(first, INTEGER_BELOW_ROWS * integer_beats(dtype))


class TorchQuantLinear(QuantLinear):
    kernel = "torch-dequantize"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        weight = dequantize(self.packed).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


class KQuantLinear(QuantLinear):
    """Given `tiles` (a buffer the model's layers share), calls of ONEDNN_FROM_ROWS rows or more
    dequantize the weight into it for oneDNN's GEMM where that measured faster (onednn_beats)."""

    def __init__(self, weight: KPacked, bias: torch.Tensor | None, activations: str = "int8x2",
                 tiles: Bf16Tiles | None = None) -> None:
        super().__init__(weight, bias)
        kernel = kquant_kernel()
        assert kernel is not None, "KQuantLinear needs the compiled kernel (see kquant_kernel())"
        parts = ACTIVATION_PARTS[activations]
        self._few = kernel.bind(weight, parts)
        self._many = kernel.bind(weight, 1) if parts > 1 else self._few
        self._tiles = tiles if tiles is not None and has_onednn_bf16() and onednn_beats("K-quant kernel") else None
        many = f"; from {MANY_ROWS} rows x int8" if parts > 1 else ""
        many += f"; from {ONEDNN_FROM_ROWS} onednn" if self._tiles is not None else ""
        self.kernel = f"kq_matmul_{weight.kind} [{kernel.isa}] (x {activations}{many})"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype; a row's result depends only on which side of
        MANY_ROWS (and ONEDNN_FROM_ROWS) its call's row count is."""
        if self._tiles is not None and x.shape[0] >= ONEDNN_FROM_ROWS:
            out = onednn_matmul(x, self._many.dequantize_bf16_rows(self._tiles))
        else:
            x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
            out = (self._many if x.shape[0] >= MANY_ROWS else self._few).run(x32)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def matmul_call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """The kernel's call, which is what `self(x)` runs for fp32 x below MANY_ROWS rows."""
        if x.dtype != torch.float32 or x.shape[0] >= MANY_ROWS:
            return None
        return self._few.call(x, out)


class ConcatLinear(Linear):
    """Several layers over the same input whose outputs are concatenated: y = [l1(x), l2(x), ...]."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.bias = None

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        return torch.cat([p(x, rows) for p in self.parts], dim=-1)

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """The parts' calls, each writing its columns of `out`, as one call: where every part is a
        K-quant layer (whose kernel writes into a column slice) and the step kernels load."""
        step = step_kernels()
        if step is None or not all(isinstance(p, KQuantLinear) for p in self.parts):
            return None
        columns = out.split([p.out_features for p in self.parts], dim=1)
        calls = [p.call(x, c) for p, c in zip(self.parts, columns)]
        return None if any(c is None for c in calls) else step.calls_as_one(calls)
