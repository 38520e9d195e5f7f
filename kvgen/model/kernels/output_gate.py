"""The compiled output gate of Qwen3.5's gated attention (output_gate.c): x * sigmoid(gate).

Built like the paged decode kernel (kvgen/model/kernels/build.py: the host's ISA, never AMX); where it
cannot be built `output_gate_kernel()` is None and the block uses torch's ops (and has no fused form).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("output_gate.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Args(ctypes.Structure):
    """`struct output_gate_args` of output_gate.c."""

    _fields_ = [("x", _P), ("gate", _P), ("out", _P), ("rows", _I64), ("heads", _I64), ("dim", _I64),
                ("gate_row", _I64), ("gate_head", _I64)]


class OutputGate:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._call = library.output_gate_call
        self._call.argtypes, self._call.restype = [ctypes.POINTER(_Args)], ctypes.c_int

    def __call__(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] fp32, gate [T, heads, D] fp32 (each head's D contiguous) -> x * sigmoid(gate)
        [T, heads * D]."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], x.shape[1] * x.shape[2])
        self._call(ctypes.byref(self.call(x, gate, out.view(x.shape)).args))
        return out

    def call(self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = x * sigmoid(gate), x and out [T, heads, D] fp32 contiguous, as a KernelCall."""
        if (any(t.dtype != torch.float32 or t.shape != x.shape or t.dim() != 3 for t in (gate, out))
                or not x.is_contiguous() or not out.is_contiguous() or gate.stride(2) != 1):
            raise ValueError(f"output gate: x, out [T, heads, D] fp32 contiguous and gate [T, heads, D] fp32 with "
                             f"contiguous heads; got {x.dtype} {list(x.shape)}, {gate.dtype} {list(gate.shape)} "
                             f"strides {gate.stride()}, {list(out.shape)}")
        rows, heads, dim = x.shape
        args = _Args(x.data_ptr(), gate.data_ptr(), out.data_ptr(), rows, heads, dim, gate.stride(0), gate.stride(1))
        return KernelCall(self._call, args, keep=(x, gate, out))


@functools.cache
def output_gate_kernel() -> OutputGate | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return OutputGate(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("output gate kernel unavailable (%s); torch's sigmoid is used", e)
        return None
