"""Qwen3.5's Gated DeltaNet layer as a block: its projections here, the layer's math in
kvgen.model.delta_net_layer (prefill, decode, verify), its memory in the state pool's slots.

    in_proj(h) = [ mixed (conv_dim) | z (Hv * Dv) | b (Hv) | a (Hv) ]       one matmul
    y          = delta_net_layer(mixed, z, a, b) over the sequence's conv window and state
    out        = out_proj(y)

A step's rows come in the order the runner laid them out (kvgen.model.blocks.base.StateBatch):
the decodes first, one token each, run as one batch through the C step that updates their slots in
place; then each verify chunk, whose state after every position goes to its checkpoint row, the slot
left as it was until the engine accepts a number of positions (kvgen.cache.state_pool); then the
prompt chunks, all in one ragged call that continues each from its slot and leaves it updated. A fused
decode step of decodes only runs the decode's C kernels from its call list, on the slots in place.
"""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedDeltaNetSpec
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.delta_net_layer import DeltaNetLayer, decode, prefill_ragged, verify
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.gated_delta_net import GatedNorm, gated_delta_net_kernel
from kvgen.model.linear import Linear


@register(GatedDeltaNetSpec.kind)
class GatedDeltaNetBlock(Block):
    kind = GatedDeltaNetSpec.kind

    def __init__(self, spec: GatedDeltaNetSpec, index: int, ctx: BuildContext) -> None:
        cfg, w, build = ctx.config, ctx.weights, ctx.build
        p = f"model.layers.{index}.{spec.prefix}."
        s = self.shape = cfg.recurrent
        self.index = index
        self.in_proj: Linear = build.linear([w[p + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")])
        self.out: Linear = build.linear([w[p + "out_proj.weight"]])  # Hv * Dv -> hidden

        def fp32(name: str) -> torch.Tensor:
            return build.float(w[p + name]).float()

        gguf = cfg.recurrent_layout == "gguf"
        decay_rate = fp32("decay_rate") if gguf else -fp32("A_log").exp()  # as transformers computes it
        self.layer = DeltaNetLayer(s, fp32("conv1d.weight").reshape(s.conv_dim, s.conv_kernel), fp32("dt_bias"),
                                   decay_rate, fp32("norm.weight"), cfg.rms_norm_eps, "tiled" if gguf else "grouped")
        self.kernel = gated_delta_net_kernel() if build.device.type == "cpu" else None
        self.split = (s.conv_dim, s.v_heads * s.v_dim, s.v_heads, s.v_heads)

    def projections(self) -> dict[str, Linear]:
        return {"in_proj": self.in_proj, "out_proj": self.out}

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        states = step.states
        if states is None:
            raise ValueError("a Gated DeltaNet layer keeps a state per sequence: it runs in the paged engine")
        mixed, z, b, a = self.in_proj(h, step.rows).split(self.split, dim=-1)  # [T, conv_dim], [T, Hv Dv], [T, Hv] x 2
        conv, state = states.layer(self.index)  # [slots, conv_dim, K - 1], [slots, Hv, Dk, Dv]
        y = torch.empty(h.shape[0], self.split[1], dtype=h.dtype, device=h.device)
        n, rows, kernel = states.num_decodes, states.row_starts, self.kernel
        if n:
            y[:n] = decode(self.layer, mixed[:n], z[:n], a[:n], b[:n], conv, state, states.slots[:n], kernel)
        prompts = [seq for seq in range(n, len(rows) - 1) if states.verify_rows[seq] is None]
        for seq in range(n, len(rows) - 1):
            if (row := states.verify_rows[seq]) is not None:
                r0, r1, slot = rows[seq], rows[seq + 1], int(states.slots[seq])
                conv_points, state_points = states.checkpoints(self.index)
                y[r0:r1], conv_points[row, : r1 - r0], state_points[row, : r1 - r0] = verify(
                    self.layer, mixed[r0:r1], z[r0:r1], a[r0:r1], b[r0:r1], conv[slot], state[slot], kernel)
        if prompts:  # the step's last rows, one sequence's chunk after another
            r0 = rows[prompts[0]]
            lengths = [rows[seq + 1] - rows[seq] for seq in prompts]
            y[r0:] = prefill_ragged(self.layer, mixed[r0:], z[r0:], a[r0:], b[r0:], conv, state,
                                    states.slots[prompts], lengths, kernel)
        return self.out(y, step.rows)

    def reserve_buffers(self, program: FusedProgram) -> None:
        s = self.shape
        program.buffer("delta_in", (sum(self.split),)), program.buffer("delta_conv", (s.conv_dim,))
        program.buffer("delta_g", (s.v_heads,)), program.buffer("delta_beta", (s.v_heads,))
        program.buffer("delta_y", (s.v_heads * s.v_dim,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        """decode's C path as calls (kvgen.model.delta_net_layer._kernel_layer, fp32): in_proj, the gates,
        the conv and the rule with its gated norm on the slots program.state_slots names, out_proj."""
        if self.kernel is None or program.states is None or program.h.dtype != torch.float32:
            return None
        conv, state = program.states.layer(self.index)  # [slots, conv_dim, K - 1], [slots, Hv, Dk, Dv]
        if conv.dtype != torch.float32:
            return None  # decode runs the torch forms on such a pool
        s, rows, layer = self.shape, program.rows, self.layer
        projected = program.buffer("delta_in", (sum(self.split),))
        mixed, z, b, a = projected.split(self.split, dim=-1)  # [rows, conv_dim], [rows, Hv Dv], [rows, Hv] x 2
        x = program.buffer("delta_conv", (s.conv_dim,))
        g, beta = program.buffer("delta_g", (s.v_heads,)), program.buffer("delta_beta", (s.v_heads,))
        y = program.buffer("delta_y", (s.v_heads * s.v_dim,))
        slots = program.state_slots
        gate = GatedNorm(z, layer.norm_weight.float().contiguous(), layer.eps)
        return [self.in_proj.call(program.h, projected),
                self.kernel.gates_call(a, b, layer.dt_bias, layer.decay_rate, g, beta),
                self.kernel.conv_step_call(mixed, layer.conv_weight, conv, slots, x),
                self.kernel.step_call(*layer.split(x), g, beta, state, slots, y.view(rows, s.v_heads, s.v_dim),
                                      layer.v_head_order, gate=gate),
                self.out.call(y, program.out)]
