"""The gated MLP: down(act(gate(h)) * up(h)), gate and up in one matmul; SwiGLU (silu) or GeGLU
(tanh GELU), each with a C kernel on the CPU (kvgen.model.layers.make_gate_mul)."""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedMLPSpec
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.kernels.build import KernelCall
from kvgen.model.layers import make_gate_mul
from kvgen.model.linear import Linear


@register(GatedMLPSpec.kind)
class GatedMLP(Block):
    kind = GatedMLPSpec.kind

    def __init__(self, spec: GatedMLPSpec, index: int, ctx: BuildContext) -> None:
        w, build = ctx.weights, ctx.build
        p = f"model.layers.{index}.{spec.prefix}."
        names = ["gate_up_proj"] if spec.fused_gate_up else ["gate_proj", "up_proj"]
        self.gate_up: Linear = build.linear([w[p + n + ".weight"] for n in names])  # hidden -> 2 * intermediate
        self.down: Linear = build.linear([w[p + "down_proj.weight"]])  # intermediate -> hidden
        self.activation = spec.activation
        self.gate_mul = make_gate_mul(spec.activation, build.device, build.dtype)

    def projections(self) -> dict[str, Linear]:
        return {"gate_up": self.gate_up, "down": self.down}

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.down(self.gate_mul(self.gate_up(h, step.rows)), step.rows)

    def reserve_buffers(self, program: FusedProgram) -> None:
        self._buffers(program)

    def _buffers(self, program: FusedProgram) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [rows, 2n] (gate and up, side by side) and act [rows, n], named by width (Gemma 4's
        layers sharing K/V have MLPs twice as wide)."""
        inner = self.gate_up.out_features
        return program.buffer(f"gate_up{inner}", (inner,)), program.buffer(f"act{inner // 2}", (inner // 2,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None]:
        gate_up, act = self._buffers(program)
        return [self.gate_up.call(program.h, gate_up), program.step.gate_mul_call(self.activation, gate_up, act),
                self.down.call(act, program.out)]
