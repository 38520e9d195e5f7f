"""A Gated DeltaNet layer between its projections, in the shapes an engine step runs it: a prompt chunk
(`prefill`; `prefill_ragged`: several sequences' chunks in one batch, over the state pool's rows by slot),
one token of each of B sequences (`decode`, over the pool), and a verify chunk that keeps the state after
each position (`verify`, for speculative decoding). Each takes `kernel`, the C forms
(kvgen.model.kernels.gated_delta_net), which run where it is given, the inputs are on the CPU and the
pool is fp32. A bf16 model's inputs are widened for them: they run in fp32 throughout, without the bf16
roundings the torch forms (as transformers) make between the conv, the rule and the norm, so there a
layer's outputs differ from the torch forms' by bf16 rounding, not fp32's.

The model keeps the projections (in_proj_qkv -> `mixed` [T, conv_dim], in_proj_z -> `z` [T, Hv * Dv],
in_proj_a / in_proj_b -> `a`, `b` [T, Hv]; out_proj on the result), so that they run on whatever matmul
kernels the model's other linear layers get. Here: conv + SiLU, the q/k/v split, the gates, the delta
rule and the gated norm (kvgen.model.gated_delta_net). The result `y` [T, Hv * Dv] is out_proj's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.config import RecurrentShape
from kvgen.model.gated_delta_net import (V_HEAD_ORDERS, causal_conv1d, conv1d_step, delta_rule_chunked,
                                         delta_rule_recurrent, delta_rule_step, gated_rms_norm, gates)
from kvgen.model.kernels.gated_delta_net import GatedNorm


@dataclass(frozen=True)
class DeltaNetLayer:
    """One layer's own weights: conv_weight [conv_dim, K], dt_bias [Hv], decay_rate [Hv] (= -exp(A_log):
    HF's A_log converted at load, or a GGUF's ssm_a as stored), norm_weight [Dv] (plain w), and how its
    value heads read the key heads (a GGUF's are "tiled", see kvgen.model.gated_delta_net)."""

    shape: RecurrentShape
    conv_weight: torch.Tensor
    dt_bias: torch.Tensor
    decay_rate: torch.Tensor
    norm_weight: torch.Tensor
    eps: float = 1e-6
    v_head_order: str = "grouped"

    def __post_init__(self) -> None:
        s = self.shape
        if (self.conv_weight.shape != (s.conv_dim, s.conv_kernel) or self.dt_bias.shape != (s.v_heads,)
                or self.decay_rate.shape != (s.v_heads,) or self.norm_weight.shape != (s.v_dim,)
                or self.v_head_order not in V_HEAD_ORDERS):
            raise ValueError(f"Gated DeltaNet layer of {s}: conv [{s.conv_dim}, {s.conv_kernel}], dt_bias and "
                             f"decay [{s.v_heads}], norm [{s.v_dim}]; got {list(self.conv_weight.shape)}, "
                             f"{list(self.dt_bias.shape)}, {list(self.decay_rate.shape)}, {list(self.norm_weight.shape)}")

    @classmethod
    def from_hf(cls, shape: RecurrentShape, conv1d_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                norm_weight: torch.Tensor, eps: float = 1e-6) -> DeltaNetLayer:
        """From a Hugging Face checkpoint's tensors (conv1d.weight is [conv_dim, 1, K])."""
        return cls(shape, conv1d_weight.reshape(shape.conv_dim, shape.conv_kernel), dt_bias,
                   -A_log.float().exp(), norm_weight, eps, "grouped")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output x [T, conv_dim] -> views q, k [T, Hk, Dk], v [T, Hv, Dv]."""
        s = self.shape
        kd = s.k_heads * s.k_dim
        return (x[:, :kd].unflatten(1, (s.k_heads, s.k_dim)), x[:, kd:2 * kd].unflatten(1, (s.k_heads, s.k_dim)),
                x[:, 2 * kd:].unflatten(1, (s.v_heads, s.v_dim)))

    def _finish(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [T, Hv, Dv], z [T, Hv * Dv] -> the gated norm, [T, Hv * Dv] in the model's dtype."""
        return gated_rms_norm(o.to(dtype), z.unflatten(1, o.shape[1:]), self.norm_weight, self.eps).flatten(1)


def prefill(layer: DeltaNetLayer, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            window: torch.Tensor | None = None, state: torch.Tensor | None = None, chunk_size: int = 64,
            kernel=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt chunk of one sequence, from its conv window [conv_dim, K - 1] and state [Hv, Dk, Dv] (None:
    the sequence's start) -> (y [T, Hv * Dv], the new window, the new state fp32). Neither input is
    modified: the caller writes the results into the sequence's slot. `kernel`: as decode's (the C rule
    runs token by token; chunk_size is the torch form's)."""
    if _runs_in_c(kernel, mixed):
        conv_pool, state_pool = _one_slot(layer, window, state)
        y = prefill_ragged(layer, mixed, z, a, b, conv_pool, state_pool, _FIRST_SLOT, [mixed.shape[0]], kernel)
        return y, conv_pool[0], state_pool[0]
    x, new_window = causal_conv1d(mixed, layer.conv_weight, window)
    q, k, v = layer.split(x)
    g, beta = gates(a, b, layer.dt_bias, decay_rate=layer.decay_rate)
    o, new_state = delta_rule_chunked(q, k, v, g, beta, state, layer.v_head_order, chunk_size=chunk_size)
    return layer._finish(o, z, mixed.dtype), new_window, new_state


def prefill_ragged(layer: DeltaNetLayer, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                   lengths: list[int] | torch.Tensor, kernel=None) -> torch.Tensor:
    """Prompt chunks of N sequences in one batch: their rows one after another in mixed [rows, conv_dim],
    z, a, b (sequence n's are lengths[n] rows), each continuing from its slot slots[n] of the pool's layer
    rows (as decode's; a fresh slot is zeros, a sequence's start) and left there updated -> y [rows, Hv * Dv].
    The C kernel runs all sequences in one call; the torch form one sequence at a time."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.shape != slots.shape or int(lengths.sum()) != mixed.shape[0]:
        raise ValueError(f"ragged prefill: {list(slots.shape)} slots and lengths {lengths.tolist()} for "
                         f"{mixed.shape[0]} rows")
    if not _runs_in_c(kernel, mixed, conv_pool):
        starts = [0, *lengths.cumsum(0).tolist()]
        pieces = []
        for n, slot in enumerate(slots.tolist()):
            rows = slice(starts[n], starts[n + 1])
            y, conv_pool[slot], state_pool[slot] = prefill(layer, mixed[rows], z[rows], a[rows], b[rows],
                                                           conv_pool[slot], state_pool[slot])
            pieces.append(y)
        return torch.cat(pieces) if pieces else z[:0]
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    y, _ = _kernel_layer(layer, mixed, z, a, b, conv_pool, state_pool, slots, starts, kernel, keep_states=False)
    return y


def verify(layer: DeltaNetLayer, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           window: torch.Tensor | None, state: torch.Tensor | None, kernel=None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify chunk of one sequence (its last token and the drafts): as prefill, token by token, and
    -> (y [T, Hv * Dv], windows [T, conv_dim, K - 1], states [T, Hv, Dk, Dv]): the conv window and state
    after each position, for the state pool's checkpoints (kvgen.cache.state_pool: accepting n tokens
    keeps entry n - 1). `kernel`: as decode's."""
    T, K = mixed.shape[0], layer.shape.conv_kernel
    if window is None:  # a sequence's start
        window = torch.zeros(layer.shape.conv_window, dtype=mixed.dtype, device=mixed.device)
    inputs = torch.cat([window.to(mixed.dtype), mixed.t()], dim=1)         # [conv_dim, K - 1 + T]
    windows = inputs.unfold(1, K - 1, 1)[:, 1:].permute(1, 0, 2)            # [T, conv_dim, K - 1]
    if _runs_in_c(kernel, mixed):
        conv_pool, state_pool = _one_slot(layer, window, state)
        y, states = _kernel_layer(layer, mixed, z, a, b, conv_pool, state_pool, _FIRST_SLOT, torch.tensor([0, T]),
                                  kernel, keep_states=True)
        return y, windows, states
    x, _ = causal_conv1d(mixed, layer.conv_weight, window)
    q, k, v = layer.split(x)
    g, beta = gates(a, b, layer.dt_bias, decay_rate=layer.decay_rate)
    o, states = delta_rule_recurrent(q, k, v, g, beta, state, layer.v_head_order, keep_states=True)
    return layer._finish(o, z, mixed.dtype), windows, states


def decode(layer: DeltaNetLayer, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, kernel=None) -> torch.Tensor:
    """One token of each of B sequences: mixed [B, conv_dim], z [B, Hv * Dv], a, b [B, Hv]; the pool's
    layer rows conv_pool [num_slots, conv_dim, K - 1], state_pool [num_slots, Hv, Dk, Dv] (StatePool.layer)
    updated in place at `slots` [B] -> y [B, Hv * Dv]. `kernel`: a GatedDeltaNetKernel
    (kvgen.model.kernels.gated_delta_net, fp32 on the CPU) or None for the torch forms."""
    if _runs_in_c(kernel, mixed, conv_pool):
        return _kernel_layer(layer, mixed, z, a, b, conv_pool, state_pool, slots, None, kernel, keep_states=False)[0]
    g, beta = gates(a, b, layer.dt_bias, decay_rate=layer.decay_rate)
    windows, states = conv_pool[slots], state_pool[slots]
    x = conv1d_step(mixed, layer.conv_weight, windows)
    q, k, v = layer.split(x)
    o = delta_rule_step(q, k, v, g, beta, states, layer.v_head_order)
    conv_pool[slots], state_pool[slots] = windows.to(conv_pool.dtype), states
    return layer._finish(o, z, mixed.dtype)


# -- the C kernel's path -----------------------------------------------------------------------------

_FIRST_SLOT = torch.zeros(1, dtype=torch.int64)


def _runs_in_c(kernel, mixed: torch.Tensor, conv_pool: torch.Tensor | None = None) -> bool:
    """Whether the C kernel runs this call: there is one, the inputs are on the CPU, and the pool is fp32."""
    return (kernel is not None and mixed.device.type == "cpu" and mixed.is_floating_point()
            and (conv_pool is None or conv_pool.dtype == torch.float32))


def _one_slot(layer: DeltaNetLayer, window: torch.Tensor | None, state: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of one slot holding copies of window and state (zeros for None), for the kernel's in-place calls
    on a caller's tensors that must stay as they are."""
    conv_pool = torch.zeros(1, *layer.shape.conv_window)
    state_pool = torch.zeros(1, *layer.shape.state)
    if window is not None:
        conv_pool[0] = window
    if state is not None:
        state_pool[0] = state
    return conv_pool, state_pool


def _kernel_layer(layer: DeltaNetLayer, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor | None,
                  kernel, keep_states: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conv, the rule and the gated norm of N sequences' rows in C (starts None: one row each), the
    pool updated at `slots` -> (y [rows, Hv * Dv] in mixed's dtype, the states after each row with
    keep_states). A bf16 model's rows are widened: all of it runs in fp32, y rounded once at the end."""
    x = kernel.conv_tokens(mixed.float(), layer.conv_weight, conv_pool, slots, starts)
    q, k, v = layer.split(x)
    g, beta = kernel.gates(a.float(), b.float(), layer.dt_bias, layer.decay_rate)
    gate = GatedNorm(z.float(), layer.norm_weight.float().contiguous(), layer.eps)
    y, states = kernel.rule_tokens(q, k, v, g, beta, state_pool, slots, starts, layer.v_head_order,
                                   keep_states=keep_states, gate=gate)
    return y.flatten(1).to(mixed.dtype), states
