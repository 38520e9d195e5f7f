"""The compiled RMSNorm (rms_norm.c): loading it and calling it.

Built like the paged decode kernel (kvgen/model/kernels/build.py: the host's ISA, never AMX);
where it cannot be built `rms_norm_kernel()` is None and kvgen.model.layers uses torch's op.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library, dtype_functions

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rms_norm.c")
DTYPES = {torch.float32: "rms_norm_f32", torch.bfloat16: "rms_norm_bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Args(ctypes.Structure):
    """`struct rms_norm_args` of rms_norm.c."""

    _fields_ = [("x", _P), ("rows", _I64), ("n", _I64), ("w", _P), ("eps", ctypes.c_float), ("y", _P)]


class RmsNorm:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = dtype_functions(library, DTYPES, [_P, _I64, _I64, _P, ctypes.c_float, _P], None)
        self._calls = dtype_functions(library, {d: f"{name}_call" for d, name in DTYPES.items()}, [_P], ctypes.c_int)

    def call(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> KernelCall:
        """out = the norm of x, all of one dtype (fp32 or bf16) and contiguous, as a KernelCall."""
        assert (x.dtype in DTYPES and weight.dtype == out.dtype == x.dtype and x.is_contiguous() and out.is_contiguous()
                and weight.is_contiguous() and x.dim() == 2 and out.shape == x.shape and weight.shape == x.shape[1:])
        args = _Args(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
        return KernelCall(self._calls[x.dtype], args, keep=(x, weight, out))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] and weight [n], both fp32 or both bf16, on the CPU -> [T, n] in that dtype."""
        if x.dtype not in DTYPES or weight.dtype != x.dtype or x.dim() != 2 or weight.shape != x.shape[1:]:
            raise ValueError(f"rms_norm: x [T, n] and weight [n] of one dtype (fp32 or bf16), not "
                             f"{x.dtype} {list(x.shape)} and {weight.dtype} {list(weight.shape)}")
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        self._functions[x.dtype](x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
        return out


@functools.cache
def rms_norm_kernel() -> RmsNorm | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return RmsNorm(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("RMSNorm kernel unavailable (%s); torch's rms_norm is used", e)
        return None
