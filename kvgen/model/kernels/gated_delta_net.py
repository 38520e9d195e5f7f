"""The compiled Gated DeltaNet rule and conv (gated_delta_net.c), over one token of each sequence (a decode
step) or each sequence's tokens (a ragged prefill, a verify chunk): loading them and calling them.

Built like the paged decode kernel (kvgen/model/kernels/__init__.py: the host's ISA, never AMX); where it
cannot be built `gated_delta_net_kernel()` is None and the torch forms of kvgen.model.gated_delta_net
run instead. fp32 only (the state is fp32 in every model dtype; a bf16 model widens q, k, v first).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.model.gated_delta_net import V_HEAD_ORDERS
from kvgen.model.kernels.build import KernelCall, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gated_delta_net.c")
MAX_DIM, MAX_KERNEL = 1024, 8  # gated_delta_net.c's
GROUP = 4  # gated_delta_net.c's: a prefill's tokens go through the rule GROUP at a time (its rounding: tests)
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _RuleArgs(ctypes.Structure):
    """`struct gdn_rule_args` of gated_delta_net.c, field for field."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("g", _P), ("beta", _P), ("states", _P), ("slots", _P),
                ("starts", _P), ("out", _P), ("kept", _P), ("z", _P), ("norm_weight", _P), ("sequences", _I64),
                ("k_heads", _I64), ("v_heads", _I64), ("k_dim", _I64), ("v_dim", _I64), ("qk_stride", _I64),
                ("v_stride", _I64), ("z_stride", _I64), ("eps", ctypes.c_float), ("tiled", _I32), ("normalize", _I32),
                ("num_threads", _I32)]


class _ConvArgs(ctypes.Structure):
    """`struct gdn_conv_args` of gated_delta_net.c."""

    _fields_ = [("x", _P), ("weight", _P), ("windows", _P), ("slots", _P), ("starts", _P), ("out", _P),
                ("sequences", _I64), ("channels", _I64), ("kernel", _I64), ("x_stride", _I64), ("num_threads", _I32)]


class _GatesArgs(ctypes.Structure):
    """`struct gdn_gates_args` of gated_delta_net.c."""

    _fields_ = [("a", _P), ("b", _P), ("dt_bias", _P), ("decay_rate", _P), ("g", _P), ("beta", _P), ("rows", _I64),
                ("heads", _I64), ("a_stride", _I64), ("b_stride", _I64)]


def _rows(x: torch.Tensor, heads: int, dim: int, name: str) -> int:
    """x [B, heads, dim] fp32 with each row's heads contiguous -> its row stride."""
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[1:] != (heads, dim) or x.stride()[1:] != (dim, 1):
        raise ValueError(f"gated delta net step: {name} [B, {heads}, {dim}] fp32 with contiguous heads, not "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()}")
    return x.stride(0)


def _check_slots(slots: torch.Tensor, num_slots: int, distinct: bool) -> torch.Tensor:
    """slots [N] -> int64 contiguous; IndexError outside the pool, ValueError for a slot given twice where
    its sequences' tokens would race (`distinct`: a prefill's)."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise IndexError(f"gated delta net: slots outside the pool's {num_slots}")
    if distinct and slots.unique().numel() != slots.numel():
        raise ValueError("gated delta net: a slot given to two sequences of one call")
    return slots.to(torch.int64).contiguous()


def _check_starts(starts: torch.Tensor | None, sequences: int, rows: int) -> torch.Tensor | None:
    """starts [N + 1] (sequence n's rows are starts[n] .. starts[n + 1] - 1) -> int64 contiguous; None
    (one row per sequence) needs N rows."""
    if starts is None:
        if rows != sequences:
            raise ValueError(f"gated delta net: {rows} rows for {sequences} sequences without starts")
        return None
    starts = starts.to(torch.int64).contiguous()
    if (starts.shape != (sequences + 1,) or int(starts[0]) != 0 or int(starts[-1]) != rows
            or bool((starts.diff() < 0).any())):
        raise ValueError(f"gated delta net: starts [{sequences + 1}] from 0 up to {rows} rows, not {starts.tolist()}")
    return starts


@dataclass(frozen=True)
class GatedNorm:
    """The layer's gated norm for the rule to end with, w * rmsnorm(o) * silu(z) per value head
    (kvgen.model.gated_delta_net.gated_rms_norm): z [rows, Hv * Dv] fp32 (rows may be strided), weight
    [Dv] fp32 (plain w), eps."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float

    def check(self, rows: int, v_heads: int, v_dim: int) -> None:
        z, w = self.z, self.weight
        if (z.dtype != torch.float32 or z.shape != (rows, v_heads * v_dim) or z.stride(1) != 1
                or w.dtype != torch.float32 or w.shape != (v_dim,) or not w.is_contiguous()):
            raise ValueError(f"gated norm: z [{rows}, {v_heads * v_dim}] fp32 with contiguous rows, weight [{v_dim}] "
                             f"fp32; got {z.dtype} {list(z.shape)}, {w.dtype} {list(w.shape)}")


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class GatedDeltaNetKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._rule, self._conv = library.gdn_rule, library.gdn_conv
        self._rule.argtypes, self._rule.restype = [ctypes.POINTER(_RuleArgs)], ctypes.c_int
        self._conv.argtypes, self._conv.restype = [ctypes.POINTER(_ConvArgs)], ctypes.c_int
        self._gates = library.gdn_gates
        self._gates.argtypes, self._gates.restype = [ctypes.POINTER(_GatesArgs)], ctypes.c_int

    def gates(self, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
              decay_rate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [rows, Hv] fp32 (rows may be strided), dt_bias, decay_rate [Hv] -> (g, beta) [rows, Hv] fp32:
        kvgen.model.gated_delta_net.gates, up to rounding."""
        g, beta = torch.empty(a.shape), torch.empty(b.shape)
        self._gates(ctypes.byref(self.gates_call(a, b, dt_bias, decay_rate, g, beta).args))
        return g, beta

    def gates_call(self, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, decay_rate: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor) -> KernelCall:
        """`gates` into g, beta [rows, Hv] (fp32, contiguous) as a KernelCall (see step_call)."""
        rows, heads = g.shape
        dt_bias, decay_rate = dt_bias.float().contiguous(), decay_rate.float().contiguous()
        if (any(t.dtype != torch.float32 or t.shape != (rows, heads) for t in (a, b, g, beta))
                or a.stride(1) != 1 or b.stride(1) != 1 or not g.is_contiguous() or not beta.is_contiguous()
                or dt_bias.shape != (heads,) or decay_rate.shape != (heads,)):
            raise ValueError(f"gates: a, b [rows, Hv] fp32 with contiguous rows, dt_bias and decay_rate [Hv], g and "
                             f"beta [rows, Hv] fp32 contiguous; got {list(a.shape)}, {list(b.shape)}, "
                             f"{list(dt_bias.shape)}, {list(g.shape)}")
        args = _GatesArgs(a.data_ptr(), b.data_ptr(), dt_bias.data_ptr(), decay_rate.data_ptr(), g.data_ptr(),
                          beta.data_ptr(), rows, heads, a.stride(0), b.stride(0))
        return KernelCall(self._gates, args, keep=(a, b, dt_bias, decay_rate, g, beta))

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, v_head_order: str = "grouped",
             normalize_qk: bool = True) -> torch.Tensor:
        """One token of B sequences: q, k [B, Hk, Dk] (rows may be strided alike: views into the conv's
        output), v [B, Hv, Dv], g, beta [B, Hv], fp32; states [num_slots, Hv, Dk, Dv] fp32 (a pool),
        slots [B] int64, each sequence's row, updated in place -> o [B, Hv, Dv] fp32. As
        kvgen.model.gated_delta_net.delta_rule_step on states[slots], up to rounding."""
        return self.rule_tokens(q, k, v, g, beta, states, slots, None, v_head_order, normalize_qk)[0]

    def rule_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor | None,
                    v_head_order: str = "grouped", normalize_qk: bool = True, keep_states: bool = False,
                    gate: GatedNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rule over N sequences' tokens (a ragged prefill): q, k [rows, Hk, Dk], v [rows, Hv, Dv], g,
        beta [rows, Hv] as in `step`, sequence n's rows starts[n] .. starts[n + 1] - 1 (starts [N + 1];
        None: one row each), its state states[slots[n]] updated in place -> (o [rows, Hv, Dv] fp32, or
        with `gate` the layer's gated norm of it; with keep_states the state after each row [rows, Hv, Dk,
        Dv], else None). As kvgen.model.gated_delta_net.delta_rule_recurrent (and gated_rms_norm) per
        sequence, up to rounding."""
        slots = _check_slots(slots, states.shape[0], distinct=starts is not None)
        rows, (_, v_heads, k_dim, v_dim) = q.shape[0], states.shape
        out = torch.empty(rows, v_heads, v_dim)
        kept = torch.empty(rows, v_heads, k_dim, v_dim) if keep_states else None
        call = self._rule_call(q, k, v, g, beta, states, slots, starts, out, kept, v_head_order, normalize_qk, gate)
        status = self._rule(ctypes.byref(call.args))
        if status:
            raise (ValueError(f"gated delta net: head sizes over {MAX_DIM}") if status == 1 else
                   MemoryError("gated delta net: no memory for the rule's scratch"))
        return out, kept

    def step_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  states: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, v_head_order: str = "grouped",
                  normalize_qk: bool = True, gate: GatedNorm | None = None) -> KernelCall:
        """`step` into out [B, Hv, Dv] (fp32, contiguous; with `gate`, the gated norm of o) as a KernelCall
        over these tensors' memory, for a fused decode step's call list (kvgen.model.kernels.step):
        whatever q, k, v, g, beta, slots (and gate.z) hold when it runs (g, beta fp32 contiguous and slots
        int64 contiguous already: they are not copied). The pool belongs to its StatePool, which must
        outlive the call."""
        return self._rule_call(q, k, v, g, beta, states, slots.to(torch.int64).contiguous(), None, out, None,
                               v_head_order, normalize_qk, gate)

    def _rule_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   states: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor | None, out: torch.Tensor,
                   kept: torch.Tensor | None, v_head_order: str, normalize_qk: bool,
                   gate: GatedNorm | None) -> KernelCall:
        num_slots, v_heads, k_dim, v_dim = states.shape
        rows, k_heads = q.shape[:2]
        qk_stride = _rows(q, k_heads, k_dim, "q")
        if _rows(k, k_heads, k_dim, "k") != qk_stride:
            raise ValueError("gated delta net step: q and k rows must be equally strided")
        v_stride = _rows(v, v_heads, v_dim, "v")
        starts = _check_starts(starts, slots.shape[0], rows)
        if (v.shape[0] != rows or g.shape != (rows, v_heads) or beta.shape != (rows, v_heads) or slots.dim() != 1
                or v_heads % k_heads or max(k_dim, v_dim) > MAX_DIM or v_head_order not in V_HEAD_ORDERS
                or out.shape != (rows, v_heads, v_dim)):
            raise ValueError(f"gated delta net step: g, beta [{rows}, {v_heads}], slots [N], out [{rows}, "
                             f"{v_heads}, {v_dim}], Dk, Dv <= {MAX_DIM}, v_head_order in {V_HEAD_ORDERS}")
        if not states.is_contiguous() or states.dtype != torch.float32:
            raise ValueError("gated delta net step: the state pool is contiguous fp32")
        if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in (out, kept)):
            raise ValueError("gated delta net step: out and kept are contiguous fp32")
        g, beta = g.float().contiguous(), beta.float().contiguous()
        if gate is not None:
            gate.check(rows, v_heads, v_dim)
        z, weight = (None, None) if gate is None else (gate.z, gate.weight)
        args = _RuleArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), states.data_ptr(),
                         slots.data_ptr(), _address(starts), out.data_ptr(), _address(kept), _address(z),
                         _address(weight), slots.shape[0], k_heads, v_heads, k_dim, v_dim, qk_stride, v_stride,
                         0 if z is None else z.stride(0), 0.0 if gate is None else gate.eps,
                         int(v_head_order == "tiled"), int(normalize_qk), torch.get_num_threads())
        return KernelCall(self._rule, args, keep=(q, k, v, g, beta, slots, starts, out, kept, z, weight))

    def conv_step(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """x [B, C] fp32 (rows may be strided), weight [C, K], windows [num_slots, C, K - 1] fp32 (a pool;
        each sequence's row slots[b] shifted by one, in place) -> silu(conv) [B, C] fp32. As
        kvgen.model.gated_delta_net.conv1d_step on windows[slots], up to rounding."""
        return self.conv_tokens(x, weight, windows, slots, None)

    def conv_tokens(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                    starts: torch.Tensor | None) -> torch.Tensor:
        """The conv over N sequences' tokens: x [rows, C] as in `conv_step`, sequence n's rows starts[n] ..
        starts[n + 1] - 1 (None: one row each), its window windows[slots[n]] replaced by its last K - 1
        inputs -> silu(conv) [rows, C] fp32. As kvgen.model.gated_delta_net.causal_conv1d per sequence."""
        slots = _check_slots(slots, windows.shape[0], distinct=starts is not None)
        out = torch.empty(x.shape[0], windows.shape[1])
        if self._conv(ctypes.byref(self._conv_call(x, weight, windows, slots, starts, out).args)):
            raise ValueError(f"conv: kernel sizes 1 to {MAX_KERNEL}, not {weight.shape[1]}")
        return out

    def conv_step_call(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                       out: torch.Tensor) -> KernelCall:
        """`conv_step` into out [B, C] (fp32, contiguous) as a KernelCall (see step_call)."""
        return self._conv_call(x, weight, windows, slots.to(torch.int64).contiguous(), None, out)

    def _conv_call(self, x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                   starts: torch.Tensor | None, out: torch.Tensor) -> KernelCall:
        rows, channels = x.shape
        _, _, width = windows.shape
        weight = weight.float().contiguous()
        starts = _check_starts(starts, slots.shape[0], rows)
        if (x.dtype != torch.float32 or x.stride(1) != 1 or weight.shape != (channels, width + 1)
                or windows.shape[1] != channels or windows.dtype != torch.float32 or not windows.is_contiguous()
                or slots.dim() != 1 or out.shape != (rows, channels) or out.dtype != torch.float32
                or not out.is_contiguous()):
            raise ValueError(f"conv: x [rows, C] fp32, weight [C, K], windows [slots, C, K - 1] fp32, slots [N], "
                             f"out [rows, C] fp32; got {list(x.shape)}, {list(weight.shape)}, {list(windows.shape)}, "
                             f"{list(slots.shape)}, {list(out.shape)}")
        args = _ConvArgs(x.data_ptr(), weight.data_ptr(), windows.data_ptr(), slots.data_ptr(), _address(starts),
                         out.data_ptr(), slots.shape[0], channels, width + 1, x.stride(0), torch.get_num_threads())
        return KernelCall(self._conv, args, keep=(x, weight, slots, starts, out))


@functools.cache
def gated_delta_net_kernel() -> GatedDeltaNetKernel | None:
    """The kernel, built once per machine, or None where it cannot be built."""
    try:
        return GatedDeltaNetKernel(ctypes.CDLL(str(build_library(SOURCE))))
    except OSError as e:
        log.warning("Gated DeltaNet kernel unavailable (%s); the torch forms are used", e)
        return None
