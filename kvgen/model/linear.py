"""Linear layers whose kernel is chosen once, when the weights load, for their device and dtype.

    F32Linear     fp32 on a CPU with AVX-512 or AVX2: kvgen's own kernel (kernels/f32_matmul.c) on
                  weights packed once into panels of 32 output features (one copy: a tied embedding
                  looks its rows up there). At one row it reads them ~20% faster than OpenBLAS's
                  GEMV, at 2-16 rows (a speculative verify chunk) it costs 1.1-1.6x one row where
                  OpenBLAS costs 1.5-2.2x, and at prefill's hundreds of rows it runs ~35% faster
                  than oneDNN's GEMM (BENCHMARKS.md). Every row goes through the same operations
                  whatever the row count, so a row's bits never depend on the rows beside it.
    CodedF32Linear  the same on weights in 28 bits each, losslessly (kernels/f32_coded.c, AVX-512
                  VBMI): decode reads an eighth fewer bytes for the same fp32 values.
    BlasLinear    fp32 on other CPUs (without AVX2), through OpenBLAS (numpy, on the same memory):
                  its GEMV (one row) reads the weights near memory bandwidth, about twice as fast as
                  MKL's (torch's default) one-row path, and its GEMM handles many rows at compute
                  speed.
    Bf16Linear    bf16 on a CPU with AVX-512 BF16: kvgen's own kernel (kernels/bf16_matmul.c) on
                  weights packed once into tiles of 4 rows. At decode's few rows it reads the
                  weights 1.3-2.5x faster than oneDNN's GEMV, which at one row is slower than fp32
                  OpenBLAS on the mid-size matrices; at prefill's hundreds of rows it runs ~30%
                  slower than oneDNN's GEMM, so there (ONEDNN_FROM_ROWS) the layer unpacks its
                  weight into a buffer the model's layers share and calls oneDNN: one copy of the
                  weights kept.
    CodedBf16Linear  the same, on weights stored in 12 bits each, losslessly (kernels/bf16_coded.c):
                  a low byte and a 4-bit code of the high byte. Decode reads a quarter fewer bytes
                  for the same bf16 values; rows of whole 64-column spans only. At many rows the
                  weight is decoded per call, for the bf16 kernel or oneDNN, or for the fp32 kernel
                  where that measures faster (kernels/many_rows_choice.py).
    OneDnnLinear  bf16 where the CPU has native bf16 but not that kernel's features: the weights
                  are reordered once into oneDNN's blocked layout.
    TorchLinear   everything else (CUDA, fp16...): `F.linear`.

Layers over weights that stay quantized in memory are kvgen.model.quant_linear's.
Which layer a weight gets is kvgen.model.linear_choice's decision.

On BlasLinear, by default a step's rows go through one BLAS call: GEMV for one row, GEMM for more, the fastest
choice (the engine's batches), and a row's low bits then depend on how many rows ran with it. A
`RowKernels` argument instead fixes each row's kernel by the token's role, so a row's bits do not
depend on the rows beside it; `kvgen.phases` uses it so that recomputing the whole sequence (`none`)
gives exactly what the contiguous cache gives:

    prompt tokens      one GEMM over all of them (padded to 2 rows if alone): OpenBLAS's GEMM gives a
                       row the same bits whatever the row count (2 or more)
    generated tokens   one GEMV each

That holds on OpenBLAS's SkylakeX kernels, where it was measured; its Haswell GEMM changes a row's
bits with the row count, but CPUs with AVX2 run F32Linear. (MKL rounds 1-3, 5-7 and 9-11 rows apart.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvgen.model.kernels.bf16 import Bf16Matmul, Bf16Tiles
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.coded import CodedBf16Matmul, CodedF32Matmul
from kvgen.model.kernels.f32 import F32Matmul, f32_kernel
from kvgen.model.kernels.many_rows_choice import fp32_beats
from kvgen.model.kernels.step import step_kernels
from kvgen.threads import WORKERS_SLEEP

# From this many rows of x on (prefill), a bf16 layer unpacks its weight to row-major and runs
# oneDNN's GEMM, which does there what kvgen's few-row kernel cannot. SmolLM2's 120 layer matrices
# at 128 / 256 / 512 rows: 98 / 198 / 398 ms on the kernel, 83 / 150 / 270 on oneDNN plus ~24 ms
# of unpacking (microbenchmarks): a loss at 128 rows, a gain from 256. No second copy is kept.
ONEDNN_FROM_ROWS = 256
# From this many rows of x on, a coded bf16 layer decodes its weight per call (to the bf16 kernel's
# tiles, or the fp32 kernel's panels; see CodedBf16Linear): the coded kernel, which decodes each
# span again for every 4 rows, matched the bf16 kernel up to ~8 rows and fell behind from ~15 (0.96x;
# 0.86x at 64). Fused decode steps run below 16 rows (kvgen.model.fused) on the coded kernel.
DECODED_FROM_ROWS = 16
# Many GEMV rows over a large matrix (an LM head) go tile by tile so each tile is read from memory
# once and then from cache; a tile's GEMV gives the same bits as the whole matrix's.
GEMV_TILE_BYTES = 4 << 20


def uses_blas(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers of this device and dtype run on OpenBLAS (BlasLinear)."""
    return device.type == "cpu" and dtype == torch.float32 and f32_kernel() is None


@contextmanager
def blas_owns_the_cores(device: torch.device, dtype: torch.dtype, gemv_only: bool) -> Iterator[None]:
    """Runs torch's own ops (attention, norms) on one thread while the model runs on OpenBLAS, when
    that is faster: in GEMV-only steps (decode: memory-bound, OpenBLAS's threads do the reading) and
    whenever idle workers spin (see kvgen.threads), since two spinning pools slow each other down
    many times over. Other steps with sleeping workers keep torch's threads for attention."""
    if not uses_blas(device, dtype) or (WORKERS_SLEEP and not gemv_only):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class RowKernels:
    """Rows [gemm) go through one GEMM, rows [gemv) through one GEMV each (two disjoint ranges)."""

    gemm: range
    gemv: range

    @classmethod
    def split(cls, num_rows: int, num_gemv_first: int = 0, num_gemv_last: int = 0) -> "RowKernels":
        """GEMV rows at the front (the engine's decodes) or at the back (generated tokens recomputed)."""
        if num_gemv_first:
            return cls(range(num_gemv_first, num_rows), range(0, num_gemv_first))
        return cls(range(0, num_rows - num_gemv_last), range(num_rows - num_gemv_last, num_rows))


class Linear(ABC):
    """y = x @ weight^T + bias for weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias

    @abstractmethod
    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out]. `rows` fixes each row's kernel (BlasLinear; the others' rows never
        depend on the rows beside them)."""

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """out = self(x) as a C kernel call over those buffers (kvgen.model.fused), or None where the
        layer has none: the matmul's call, then the bias added to each row, the same sums as `self(x)`'s
        `out.add_(bias)` (Qwen2's q/k/v)."""
        matmul = self.matmul_call(x, out)
        if matmul is None or self.bias is None:
            return matmul
        step = step_kernels()
        if step is None or self.bias.dtype != out.dtype:
            return None
        return step.calls_as_one([matmul, *(step.add_call(row, self.bias) for row in out)])

    def matmul_call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """out = x @ weight^T as a C kernel call over those buffers, or None where the kernel has none."""
        return None

    @property
    def weight_bytes(self) -> int:
        """Bytes the weight takes as this layer holds it (a layout's padding included)."""
        return self.weight.numel() * self.weight.element_size()


class BlasLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.weight = weight.contiguous()
        self._wt = self.weight.numpy().T  # [in, out] view: what numpy's x @ W^T wants

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        xn, on = x.numpy(), out.numpy()
        if rows is None and xn.shape[0] > 1:
            # W @ x^T, the weights as OpenBLAS's A operand: it then packs the few rows of x instead of
            # the whole matrix: 2x faster for a few rows (a speculative verify chunk) on one thread,
            # far more on two, 1.1-6x at 256-512 rows (measured in docs/speculative.md).
            on[:] = np.matmul(self._wt.T, xn.T).T
        elif rows is None:
            np.matmul(xn, self._wt, out=on)
        else:
            _gemv(xn, self._wt, on, rows.gemv)
            _gemm(xn, self._wt, on, rows.gemm)
        return out if self.bias is None else out.add_(self.bias)


class F32Linear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: F32Matmul | CodedF32Matmul) -> None:
        super().__init__(weight, bias)
        self.packed = kernel.pack(weight)
        self._matmul = kernel

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        out = self._matmul(x.contiguous(), self.packed, self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def matmul_call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        return self._matmul.call(x, self.packed, out)

    @property
    def weight_bytes(self) -> int:
        return self._matmul.packed_bytes(self.packed)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, in], from the packed copy: a tied embedding looks its
        tokens up here instead of keeping a second one."""
        return self._matmul.rows(self.packed, ids)


class CodedF32Linear(F32Linear):
    """F32Linear on the coded kernel (kvgen.model.kernels.coded): the same values, 28 bits each."""


class OneDnnLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * 2  # bf16, reordered


class Bf16Linear(Linear):
    """bf16 on kvgen's kernel; given a shared `scratch` buffer, calls of ONEDNN_FROM_ROWS rows or more
    (prefill) unpack the weight into it and run oneDNN's GEMM instead."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Bf16Matmul | CodedBf16Matmul,
                 scratch: Bf16Tiles | None = None) -> None:
        super().__init__(weight, bias)
        self.packed = kernel.pack(weight)
        self._matmul = kernel
        self._scratch = scratch if has_onednn_bf16() else None

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        if self._scratch is not None and x.shape[0] >= ONEDNN_FROM_ROWS:
            weight = self._matmul.unpack(self.packed, self.out_features, self.in_features, self._scratch)
            return F.linear(x, weight, self.bias)
        out = self._matmul(x.contiguous(), self.packed, self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def matmul_call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        return self._matmul.call(x, self.packed, out)

    @property
    def weight_bytes(self) -> int:
        return self._matmul.packed_bytes(self.packed)


class CodedBf16Linear(Bf16Linear):
    """Bf16Linear on the coded kernel (kvgen.model.kernels.coded): the same values, 12 bits each.
    Given the shared `scratch`, calls of DECODED_FROM_ROWS rows or more decode the weight into it
    instead of decoding each span again for every 4 rows of x: to the bf16 kernel's tiles (oneDNN's
    row-major from ONEDNN_FROM_ROWS), or to the fp32 kernel's panels where that measures faster
    (kvgen.model.kernels.many_rows_choice; the sums are then rounded to bf16 as the bf16 paths round theirs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CodedBf16Matmul,
                 tiles_kernel: Bf16Matmul, scratch: Bf16Tiles | None = None) -> None:
        super().__init__(weight, bias, kernel, scratch)
        self._tiles, self._tiles_kernel, self._f32 = scratch, tiles_kernel, f32_kernel()

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        path = self.path(x.shape[0])
        if path in ("coded", "onednn"):
            return super().__call__(x, rows)
        if path == "fp32":
            panels = self._matmul.decode_f32_panels(self.packed, self._tiles)
            out = self._f32(x.float().contiguous(), panels, self.out_features).to(x.dtype)
        else:
            out = self._tiles_kernel(x.contiguous(), self._matmul.decode_tiles(self.packed, self._tiles),
                                     self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def path(self, rows: int) -> str:
        """How `rows` rows of x run: "coded", "tiles", "onednn" or "fp32" (see the class docstring)."""
        if self._tiles is None or rows < DECODED_FROM_ROWS:
            return "coded"
        onednn = self._scratch is not None and rows >= ONEDNN_FROM_ROWS
        if self._f32 is not None and fp32_beats("onednn" if onednn else "bf16 kernel"):
            return "fp32"
        return "onednn" if onednn else "tiles"


class TorchLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.weight = weight

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight^T (bf16 [out, in], row-major) on oneDNN's bf16 GEMM -> fp32 [T, out], the
    sums rounded to bf16 as oneDNN returns them."""
    return F.linear(x.to(torch.bfloat16), weight).float()


def has_onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _gemv(xn: np.ndarray, wt: np.ndarray, on: np.ndarray, rows: range) -> None:
    tile = wt.shape[1] if len(rows) < 2 else max(1, GEMV_TILE_BYTES // (wt.shape[0] * wt.itemsize))
    for start in range(0, wt.shape[1], tile):
        columns = slice(start, start + tile)
        for r in rows:
            np.matmul(xn[r : r + 1], wt[:, columns], out=on[r : r + 1, columns])


def _gemm(xn: np.ndarray, wt: np.ndarray, on: np.ndarray, rows: range) -> None:
    if len(rows) >= 2:
        np.matmul(xn[rows.start : rows.stop], wt, out=on[rows.start : rows.stop])
    elif len(rows) == 1:  # one row would take the GEMV path: pad to two
        padded = np.zeros((2, xn.shape[1]), dtype=xn.dtype)
        padded[0] = xn[rows.start]
        on[rows.start] = (padded @ wt)[0]
