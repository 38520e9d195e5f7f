"""The compiled step kernels (step.c): the gated MLPs' act(gate) * up (SwiGLU's silu, GeGLU's tanh
GELU), the residual add, the scale by a layer scalar, and call lists.

Built like the paged decode kernel (kvgen/model/kernels/build.py: the host's ISA, never AMX);
where it cannot be built `step_kernels()` is None: kvgen.model.layers then uses torch's ops, and
kvgen.model.fused runs no call lists.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.kernels.build import KernelCall, build_library, dtype_functions

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("step.c")
SILU_DTYPES = {torch.float32: "silu_mul_f32", torch.bfloat16: "silu_mul_bf16"}
GATE_ACTIVATIONS = ("silu", "gelu_tanh")  # kvgen.architectures.spec.ACTIVATIONS, each with a kernel
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _GateArgs(ctypes.Structure):
    """`struct gate_mul_args` of step.c."""

    _fields_ = [("gate", _P), ("gate_stride", _I64), ("up", _P), ("up_stride", _I64), ("rows", _I64), ("n", _I64),
                ("out", _P), ("num_threads", ctypes.c_int32)]


class _AddArgs(ctypes.Structure):
    """`struct add_args` of step.c."""

    _fields_ = [("x", _P), ("y", _P), ("n", _I64)]


class _ScaleArgs(ctypes.Structure):
    """`struct scale_args` of step.c."""

    _fields_ = [("x", _P), ("s", _P), ("n", _I64)]


class _ConvertArgs(ctypes.Structure):
    """`struct convert_args` of step.c."""

    _fields_ = [("src", _P), ("rows", _I64), ("n", _I64), ("stride", _I64), ("dst", _P)]


class _Call(ctypes.Structure):
    """`struct call` of step.c."""

    _fields_ = [("run", _P), ("args", _P)]


class CallList:
    """Kernel calls run in order by one ctypes call (`run_calls` in step.c)."""

    def __init__(self, run_calls: ctypes._CFuncPtr, calls: list[KernelCall]) -> None:
        self._calls = calls  # their argument structs and tensors stay alive
        self._array = (_Call * len(calls))(*[(c.address, ctypes.addressof(c.args)) for c in calls])
        self._run_calls = run_calls

    def __call__(self) -> None:
        if self._run_calls(self._array, len(self._calls)):
            raise MemoryError("fused decode step: a kernel ran out of memory for its scratch space")


class _CallListArgs(ctypes.Structure):
    """`struct call_list_args` of step.c."""

    _fields_ = [("calls", _P), ("count", _I64)]


class StepKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        suffixes = {torch.float32: "f32", torch.bfloat16: "bf16"}
        names = {"silu": "silu_mul_", "gelu_tanh": "gelu_mul_"}
        self._gate_mul = {act: dtype_functions(library, {d: name + c for d, c in suffixes.items()},
                                               [_P, _I64, _P, _I64, _I64, _I64, _P, ctypes.c_int32], None)
                          for act, name in names.items()}
        self._gate_mul_calls = {act: dtype_functions(library, {d: f"{name}{c}_call" for d, c in suffixes.items()},
                                                     [_P], ctypes.c_int)
                                for act, name in names.items()}
        calls = {torch.float32: "f32_call", torch.bfloat16: "bf16_call"}
        self._add_calls = dtype_functions(library, {d: "add_" + c for d, c in calls.items()}, [_P], ctypes.c_int)
        self._scale_calls = dtype_functions(library, {d: "scale_" + c for d, c in calls.items()}, [_P], ctypes.c_int)
        self._convert_calls = {(torch.bfloat16, torch.float32): library.bf16_to_f32_call,
                               (torch.float32, torch.bfloat16): library.f32_to_bf16_call}
        self._run_calls = library.run_calls
        self._run_calls.argtypes, self._run_calls.restype = [_P, _I64], _I64
        self._run_calls_call = library.run_calls_call

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2n] (gate, then up), fp32 or bf16, on the CPU -> silu(gate) * up [T, n]."""
        return self.gate_mul("silu", gate_up)

    def gate_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2n] (gate, then up), fp32 or bf16, on the CPU -> act(gate) * up [T, n]."""
        if gate_up.dtype not in SILU_DTYPES or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"{activation}: gate_up [T, 2n] of fp32 or bf16, not {gate_up.dtype} "
                             f"{list(gate_up.shape)}")
        gate, up = gate_up.contiguous().chunk(2, dim=1)
        return self.gate_pair_mul(activation, gate, up)

    def gate_pair_mul(self, activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, n] of one dtype (fp32 or bf16), each row contiguous (rows any stride apart), on
        the CPU -> act(gate) * up [T, n]: the MLP's product where gate and up are two matrices."""
        out = torch.empty(gate.shape, dtype=gate.dtype)
        self._gate_mul[activation][gate.dtype](*_gate_arguments(gate, up, out))
        return out

    def gate_mul_call(self, activation: str, gate_up: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """out = act(gate) * up from gate_up, of one dtype (fp32 or bf16) and contiguous, as a KernelCall."""
        rows, n = out.shape
        assert gate_up.is_contiguous() and gate_up.shape == (rows, 2 * n)
        gate, up = gate_up.chunk(2, dim=1)
        return self.gate_pair_mul_call(activation, gate, up, out)

    def gate_pair_mul_call(self, activation: str, gate: torch.Tensor, up: torch.Tensor,
                           out: torch.Tensor) -> KernelCall:
        """out = act(gate) * up (see gate_pair_mul), out contiguous, as a KernelCall."""
        args = _GateArgs(*_gate_arguments(gate, up, out))
        return KernelCall(self._gate_mul_calls[activation][out.dtype], args, keep=(gate, up, out))

    def add_call(self, x: torch.Tensor, y: torch.Tensor) -> KernelCall:
        """x += y, of one dtype (fp32 or bf16), contiguous and of one shape, as a KernelCall."""
        assert x.dtype == y.dtype and x.is_contiguous() and y.is_contiguous() and x.shape == y.shape
        return KernelCall(self._add_calls[x.dtype], _AddArgs(x.data_ptr(), y.data_ptr(), x.numel()), keep=(x, y))

    def scale_call(self, x: torch.Tensor, s: torch.Tensor) -> KernelCall:
        """x *= s (one element), of one dtype (fp32 or bf16), x contiguous, as a KernelCall."""
        assert x.dtype == s.dtype and x.is_contiguous() and s.numel() == 1
        return KernelCall(self._scale_calls[x.dtype], _ScaleArgs(x.data_ptr(), s.data_ptr(), x.numel()), keep=(x, s))

    def convert_call(self, src: torch.Tensor, dst: torch.Tensor) -> KernelCall:
        """dst = src.to(dst.dtype) between bf16 and fp32, as a KernelCall: src [rows, ..., n] with its
        last dims contiguous within a row (rows src.stride(0) apart), dst contiguous of its shape."""
        rows, n = src.shape[0], src[0].numel()
        assert dst.is_contiguous() and dst.shape == src.shape and src[0].is_contiguous()
        args = _ConvertArgs(src.data_ptr(), rows, n, src.stride(0), dst.data_ptr())
        return KernelCall(self._convert_calls[src.dtype, dst.dtype], args, keep=(src, dst))

    def call_list(self, calls: list[KernelCall]) -> CallList:
        return CallList(self._run_calls, calls)

    def calls_as_one(self, calls: list[KernelCall]) -> KernelCall:
        """`calls` run in order as one KernelCall (for a call list of its own)."""
        listed = CallList(self._run_calls, calls)
        return KernelCall(self._run_calls_call, _CallListArgs(ctypes.addressof(listed._array), len(calls)),
                          keep=(listed,))


def _gate_arguments(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> tuple:
    """gate_mul's arguments for gate, up [rows, n] (each row contiguous) into contiguous out [rows, n]."""
    rows, n = out.shape
    assert (gate.dtype == up.dtype == out.dtype and gate.shape == up.shape == (rows, n) and out.is_contiguous()
            and (n == 0 or gate.stride(1) == up.stride(1) == 1))
    return (gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, n, out.data_ptr(),
            torch.get_num_threads())


@functools.cache
def step_kernels() -> StepKernels | None:
    """The kernels, built once per machine, or None where they cannot be built."""
    try:
        return StepKernels(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("step kernels unavailable (%s); SwiGLU uses torch's ops and decode steps run layer by layer", e)
        return None
