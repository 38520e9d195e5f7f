"""The linear layer over a K-quant matrix (Q4_K, Q5_K, Q6_K) in kquant.c's layout.

One integer kernel for every row count: it unpacks a panel's codes once for 8 rows of x, so a
prefill chunk reads the weights once from memory and runs on VNNI dot products, with no float copy
of the weight per call (the generic packed layers dequantize theirs to bf16 or fp32 per call from
16 rows on). x is quantized per 32 as the layer's `activations` say ("int8x2": two int8 parts,
~15 bits) below MANY_ROWS rows; from MANY_ROWS rows on, where the kernel is compute-bound and a
second part doubles its work, in one int8 part (as llama.cpp's q8 activations, with a scale per 32
where llama.cpp's Q4_K path has one per 256).
"""

from __future__ import annotations

import torch

from kvgen.model.kernels import KernelCall
from kvgen.model.linear import RowKernels
from kvgen.model.quant.kernel import ACTIVATION_PARTS
from kvgen.model.quant.kquant_format import KPacked
from kvgen.model.quant.kquant_kernel import kquant_kernel
from kvgen.model.quant.linear import QuantLinear

# From this many rows of x on, one int8 part (see the module docstring); fused decode steps run
# below 16 rows (kvgen.model.fused), so decode and verify chunks keep the layer's activations.
MANY_ROWS = 16


class KQuantLinear(QuantLinear):
    def __init__(self, weight: KPacked, bias: torch.Tensor | None, activations: str = "int8x2") -> None:
        super().__init__(weight, bias)
        kernel = kquant_kernel()
        assert kernel is not None, "KQuantLinear needs the compiled kernel (see kquant_kernel())"
        parts = ACTIVATION_PARTS[activations]
        self._few = kernel.bind(weight, parts)
        self._many = kernel.bind(weight, 1) if parts > 1 else self._few
        many = f"; from {MANY_ROWS} rows x int8" if parts > 1 else ""
        self.kernel = f"kq_matmul_{weight.kind} [avx512-vnni] (x {activations}{many})"

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype; a row's result depends only on which side of
        MANY_ROWS its call's row count is."""
        x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        out = (self._many if x.shape[0] >= MANY_ROWS else self._few).run(x32)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def call(self, x: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """The kernel's call, which is what `self(x)` runs for fp32 x below MANY_ROWS rows."""
        if self.bias is not None or x.dtype != torch.float32 or x.shape[0] >= MANY_ROWS:
            return None
        return self._few.call(x, out)
