"""The compiled Gated DeltaNet decode step and conv step (gated_delta_net.c): loading them and calling them.

Built like the paged decode kernel (kvgen/model/kernels/__init__.py: the host's ISA, never AMX); where it
cannot be built `gated_delta_net_kernel()` is None and the torch forms of kvgen.model.gated_delta_net
run instead. fp32 only (the state is fp32 in every model dtype; a bf16 model widens q, k, v first).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvgen.model.gated_delta_net import V_HEAD_ORDERS
from kvgen.model.kernels.build import KernelCall, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gated_delta_net.c")
MAX_DIM = 1024  # gated_delta_net.c's MAX_DIM
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _StepArgs(ctypes.Structure):
    """`struct gdn_step_args` of gated_delta_net.c, field for field."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("g", _P), ("beta", _P), ("states", _P), ("slots", _P),
                ("out", _P), ("batch", _I64), ("k_heads", _I64), ("v_heads", _I64), ("k_dim", _I64),
                ("v_dim", _I64), ("qk_stride", _I64), ("v_stride", _I64), ("tiled", _I32), ("normalize", _I32),
                ("num_threads", _I32)]


class _ConvArgs(ctypes.Structure):
    """`struct conv_step_args` of gated_delta_net.c."""

    _fields_ = [("x", _P), ("weight", _P), ("windows", _P), ("slots", _P), ("out", _P), ("batch", _I64),
                ("channels", _I64), ("kernel", _I64), ("x_stride", _I64), ("num_threads", _I32)]


def _rows(x: torch.Tensor, heads: int, dim: int, name: str) -> int:
    """x [B, heads, dim] fp32 with each row's heads contiguous -> its row stride."""
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[1:] != (heads, dim) or x.stride()[1:] != (dim, 1):
        raise ValueError(f"gated delta net step: {name} [B, {heads}, {dim}] fp32 with contiguous heads, not "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()}")
    return x.stride(0)


class GatedDeltaNetKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._step, self._conv = library.gdn_step, library.conv_step
        self._step.argtypes, self._step.restype = [ctypes.POINTER(_StepArgs)], ctypes.c_int
        self._conv.argtypes, self._conv.restype = [ctypes.POINTER(_ConvArgs)], ctypes.c_int

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, v_head_order: str = "grouped",
             normalize_qk: bool = True) -> torch.Tensor:
        """One token of B sequences: q, k [B, Hk, Dk] (rows may be strided alike: views into the conv's
        output), v [B, Hv, Dv], g, beta [B, Hv], fp32; states [num_slots, Hv, Dk, Dv] fp32 (a pool),
        slots [B] int64, each sequence's row, updated in place -> o [B, Hv, Dv] fp32. As
        kvgen.model.gated_delta_net.delta_rule_step on states[slots], up to rounding."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= states.shape[0]):
            raise IndexError(f"gated delta net step: slots outside the pool's {states.shape[0]}")
        out = torch.empty(q.shape[0], states.shape[1], states.shape[3])
        call = self.step_call(q, k, v, g, beta, states, slots, out, v_head_order, normalize_qk)
        if self._step(ctypes.byref(call.args)):
            raise ValueError(f"gated delta net step: head sizes over {MAX_DIM}")
        return out

    def step_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  states: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, v_head_order: str = "grouped",
                  normalize_qk: bool = True) -> KernelCall:
        """`step` into out [B, Hv, Dv] (fp32, contiguous) as a KernelCall over these tensors' memory, for a
        fused decode step's call list (kvgen.model.kernels.step): whatever q, k, v, g, beta and slots hold
        when it runs (g, beta fp32 contiguous and slots int64 contiguous already: they are not copied).
        The pool belongs to its StatePool, which must outlive the call."""
        num_slots, v_heads, k_dim, v_dim = states.shape
        batch, k_heads = q.shape[:2]
        qk_stride = _rows(q, k_heads, k_dim, "q")
        if _rows(k, k_heads, k_dim, "k") != qk_stride:
            raise ValueError("gated delta net step: q and k rows must be equally strided")
        v_stride = _rows(v, v_heads, v_dim, "v")
        if (v.shape[0] != batch or g.shape != (batch, v_heads) or beta.shape != (batch, v_heads)
                or slots.shape != (batch,) or v_heads % k_heads or max(k_dim, v_dim) > MAX_DIM
                or v_head_order not in V_HEAD_ORDERS or out.shape != (batch, v_heads, v_dim)):
            raise ValueError(f"gated delta net step: g, beta [{batch}, {v_heads}], slots [{batch}], out [{batch}, "
                             f"{v_heads}, {v_dim}], Dk, Dv <= {MAX_DIM}, v_head_order in {V_HEAD_ORDERS}")
        if not states.is_contiguous() or states.dtype != torch.float32:
            raise ValueError("gated delta net step: the state pool is contiguous fp32")
        g, beta = g.float().contiguous(), beta.float().contiguous()
        slots = slots.to(torch.int64).contiguous()
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("gated delta net step: out is contiguous fp32")
        args = _StepArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), states.data_ptr(),
                         slots.data_ptr(), out.data_ptr(), batch, k_heads, v_heads, k_dim, v_dim, qk_stride, v_stride,
                         int(v_head_order == "tiled"), int(normalize_qk), torch.get_num_threads())
        return KernelCall(self._step, args, keep=(q, k, v, g, beta, slots, out))

    def conv_step(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """x [B, C] fp32 (rows may be strided), weight [C, K], windows [num_slots, C, K - 1] fp32 (a pool;
        each sequence's row slots[b] shifted by one, in place) -> silu(conv) [B, C] fp32. As
        kvgen.model.gated_delta_net.conv1d_step on windows[slots], up to rounding."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= windows.shape[0]):
            raise IndexError(f"conv step: slots outside the pool's {windows.shape[0]}")
        out = torch.empty(x.shape[0], windows.shape[1])
        self._conv(ctypes.byref(self.conv_step_call(x, weight, windows, slots, out).args))
        return out

    def conv_step_call(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                       out: torch.Tensor) -> KernelCall:
        """`conv_step` into out [B, C] (fp32, contiguous) as a KernelCall (see step_call)."""
        batch, channels = x.shape
        _, _, width = windows.shape
        weight = weight.float().contiguous()
        if (x.dtype != torch.float32 or x.stride(1) != 1 or weight.shape != (channels, width + 1)
                or windows.shape[1] != channels or windows.dtype != torch.float32 or not windows.is_contiguous()
                or slots.shape != (batch,) or out.shape != (batch, channels) or out.dtype != torch.float32
                or not out.is_contiguous()):
            raise ValueError(f"conv step: x [B, C] fp32, weight [C, K], windows [slots, C, K - 1] fp32, slots [B], "
                             f"out [B, C] fp32; got {list(x.shape)}, {list(weight.shape)}, {list(windows.shape)}, "
                             f"{list(slots.shape)}, {list(out.shape)}")
        slots = slots.to(torch.int64).contiguous()
        args = _ConvArgs(x.data_ptr(), weight.data_ptr(), windows.data_ptr(), slots.data_ptr(), out.data_ptr(), batch,
                         channels, width + 1, x.stride(0), torch.get_num_threads())
        return KernelCall(self._conv, args, keep=(x, weight, slots, out))


@functools.cache
def gated_delta_net_kernel() -> GatedDeltaNetKernel | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return GatedDeltaNetKernel(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("Gated DeltaNet kernel unavailable (%s); the torch forms are used", e)
        return None
