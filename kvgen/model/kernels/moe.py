"""The compiled mixture-of-experts layer (moe.c): loading it and calling it.

Built with the host's flags (kvgen/model/kernels/build.py); where it cannot be built `moe_kernel()` is
None and kvgen.model.experts runs its torch reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.architectures.spec import EXPERT_ACTIVATIONS
from kvgen.model.kernels.build import KernelCall, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe.c")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class ExpertStackArgs(ctypes.Structure):
    """`struct expert_stack` of moe.c: one projection of every expert, expert e's parts at e * stride."""

    _fields_ = [("matmul", _P), ("codes", _P), ("scale", _P), ("min", _P), ("codes_stride", _I64),
                ("scale_stride", _I64), ("min_stride", _I64), ("offset", _I32), ("parts", _I32),
                ("many_rows", _I32), ("N", _I64), ("K", _I64), ("kquant", _I32)]


ACTIVATION_CODES = {name: code for code, name in enumerate(EXPERT_ACTIVATIONS)}  # moe.c's ACT_*, in that order


@dataclass(frozen=True)
class ExpertOptions:
    """What a model's experts add to plain SwiGLU experts (gpt-oss): biases on each projection's rows,
    fp32 contiguous gate_up_bias [experts, 2 * inner] (gate's then up's) and down_bias [experts,
    hidden], and the activation (one of EXPERT_ACTIVATIONS; alpha and limit: the clamped SwiGLU's)."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


class _Args(ctypes.Structure):
    """`struct moe_args` of moe.c."""

    _fields_ = [("x", _P), ("logits", _P), ("T", _I64), ("experts", _I64), ("top_k", _I64), ("norm_topk", _I32),
                ("gate_up", ExpertStackArgs), ("down", ExpertStackArgs), ("out", _P), ("counts", _P),
                ("num_threads", _I32), ("gate_up_bias", _P), ("down_bias", _P), ("activation", _I32),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


class MoEKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._forward = library.moe_forward
        self._forward.argtypes, self._forward.restype = [ctypes.POINTER(_Args)], ctypes.c_int
        self.f32_matmul = ctypes.cast(library.moe_f32_matmul, _P).value  # the fp32 stacks' matmul

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, gate_up: ExpertStackArgs, down: ExpertStackArgs,
                 top_k: int, norm_topk: bool, counts: torch.Tensor,
                 options: ExpertOptions = ExpertOptions()) -> torch.Tensor:
        """x fp32 [T, hidden] and the router's logits fp32 [T, experts], both contiguous -> fp32
        [T, hidden]; counts int64 [experts] gets each expert's number of tokens added."""
        out = torch.empty_like(x)
        args = self._args(x, logits, gate_up, down, top_k, norm_topk, counts, out, options)
        if x.shape[0] and self._forward(ctypes.byref(args)):
            raise MemoryError("mixture of experts: out of memory for a step's buffers")
        return out

    def call(self, x: torch.Tensor, logits: torch.Tensor, gate_up: ExpertStackArgs, down: ExpertStackArgs,
             top_k: int, norm_topk: bool, counts: torch.Tensor, out: torch.Tensor,
             options: ExpertOptions = ExpertOptions()) -> KernelCall:
        """out = self(x, logits, ...) as a KernelCall over those buffers (the fused decode step)."""
        args = self._args(x, logits, gate_up, down, top_k, norm_topk, counts, out, options)
        return KernelCall(self._forward, args, keep=(x, logits, counts, out, options))

    @staticmethod
    def _args(x: torch.Tensor, logits: torch.Tensor, gate_up: ExpertStackArgs, down: ExpertStackArgs, top_k: int,
              norm_topk: bool, counts: torch.Tensor, out: torch.Tensor, options: ExpertOptions) -> _Args:
        tokens, experts = logits.shape
        assert (x.dtype == logits.dtype == out.dtype == torch.float32 and x.is_contiguous() and logits.is_contiguous()
                and out.is_contiguous() and x.shape == out.shape == (tokens, down.N) and counts.dtype == torch.int64
                and counts.shape == (experts,))
        assert all(b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape[0] == experts)
                   for b in (options.gate_up_bias, options.down_bias))
        biases = [b if b is None else b.data_ptr() for b in (options.gate_up_bias, options.down_bias)]
        return _Args(x.data_ptr(), logits.data_ptr(), tokens, experts, top_k, int(norm_topk), gate_up, down,
                     out.data_ptr(), counts.data_ptr(), torch.get_num_threads(), *biases,
                     ACTIVATION_CODES[options.activation], options.alpha, options.limit)


@functools.cache
def moe_kernel() -> MoEKernel | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return MoEKernel(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("mixture-of-experts kernel unavailable (%s); a torch loop over experts is used", e)
        return None
