"""The compiled rotary embedding (rope.c): loading it and calling it.

Built like the paged decode kernel (kvgen/model/kernels/build.py: the host's ISA, never AMX),
plus -ffp-contract=off so that its bits are apply_rope's; where it cannot be built `rope_kernel()`
is None and kvgen.model.layers uses torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import FLAGS, KernelCall, build_library, dtype_functions

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rope.c")
DTYPES = {torch.float32: "rope_f32", torch.bfloat16: "rope_bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Args(ctypes.Structure):
    """`struct rope_args` of rope.c."""

    _fields_ = [("x", _P), ("rows", _I64), ("heads", _I64), ("dim", _I64), ("stride", _I64), ("cos", _P),
                ("sin", _P)]


class Rope:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = dtype_functions(library, DTYPES, [_P, _I64, _I64, _I64, _I64, _P, _P], None)
        self._calls = dtype_functions(library, {d: f"{name}_call" for d, name in DTYPES.items()}, [_P], ctypes.c_int)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotates x [T, heads, D] in place (rows may be strided, each row's heads contiguous);
        cos / signed_sin [T, 1, D] from RotaryEmbedding.tables, of x's dtype (fp32 or bf16)."""
        self._check(x, cos, signed_sin)
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        rows, heads, dim = x.shape
        self._functions[x.dtype](x.data_ptr(), rows, heads, dim, x.stride(0), cos.data_ptr(), signed_sin.data_ptr())

    def call(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> KernelCall:
        """The rotation of x by contiguous cos / signed_sin, as a KernelCall."""
        self._check(x, cos, signed_sin)
        assert cos.is_contiguous() and signed_sin.is_contiguous()
        rows, heads, dim = x.shape
        args = _Args(x.data_ptr(), rows, heads, dim, x.stride(0), cos.data_ptr(), signed_sin.data_ptr())
        return KernelCall(self._calls[x.dtype], args, keep=(x, cos, signed_sin))

    @staticmethod
    def _check(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        rows, heads, dim = x.shape
        if (x.dtype not in DTYPES or cos.dtype != x.dtype or signed_sin.dtype != x.dtype
                or x.stride()[1:] != (dim, 1) or cos.shape != (rows, 1, dim) or signed_sin.shape != cos.shape):
            raise ValueError(f"rope: x [T, heads, D] with contiguous heads and cos/sin [T, 1, D], one dtype "
                             f"(fp32 or bf16), not {x.dtype} {list(x.shape)} and {cos.dtype} {list(cos.shape)}")


@functools.cache
def rope_kernel() -> Rope | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return Rope(ctypes.CDLL(str(build_library(SOURCE, (*FLAGS, "-ffp-contract=off")))))
    except OSError as e:
        log.warning("RoPE kernel unavailable (%s); torch's ops are used", e)
        return None
