"""A mixture of experts in a branch: the router's logits (a linear layer), then the routed experts in
one C call (kvgen.model.experts); where the layer has a shared expert, a gated MLP every token runs,
scaled by sigmoid of its gate's logit, added."""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedMLPSpec, MoESpec
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.blocks.mlp import GatedMLP
from kvgen.model.kernels.build import KernelCall
from kvgen.model.experts import Experts
from kvgen.model.linear import Linear


@register(MoESpec.kind)
class MoEBlock(Block):
    kind = MoESpec.kind

    def __init__(self, spec: MoESpec, index: int, ctx: BuildContext) -> None:
        w, build, cfg = ctx.weights, ctx.build, ctx.config
        if build.device.type != "cpu":
            raise ValueError(f"{cfg.architecture}: mixtures of experts run on the CPU only (--device cpu)")
        p = f"model.layers.{index}.{spec.prefix}."
        self.router: Linear = build.linear([w[p + "gate.weight"]])  # hidden -> experts
        self.experts = Experts(*(w[p + f"experts.{n}_proj.weight"] for n in ("gate", "up", "down")),
                               top_k=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob,
                               activations=build.activations)
        self.shared: GatedMLP | None = None
        self.shared_gate: Linear | None = None  # hidden -> 1
        if spec.shared_expert:
            self.shared = GatedMLP(GatedMLPSpec(prefix=f"{spec.prefix}.shared_expert"), index, ctx)
            self.shared_gate = build.linear([w[p + "shared_expert_gate.weight"]])

    def projections(self) -> dict[str, Linear]:
        shared = {} if self.shared is None else {"shared_gate_up": self.shared.gate_up,
                                                 "shared_down": self.shared.down, "shared_gate": self.shared_gate}
        return {"router": self.router} | shared

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        logits = self.router(h, step.rows).float()
        out = self.experts(h.float(), logits).to(h.dtype)
        if self.shared is not None:
            out += torch.sigmoid(self.shared_gate(h, step.rows)) * self.shared.forward(h, step)
        return out

    def reserve_buffers(self, program: FusedProgram) -> None:
        program.buffer("router_logits", (self.experts.num_experts,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        """The router's call and the experts' (fp32 steps: the expert kernel reads and writes fp32)."""
        if program.h.dtype != torch.float32 or self.shared is not None:  # a shared expert: layer by layer
            return None
        logits = program.buffer("router_logits", (self.experts.num_experts,))
        return [self.router.call(program.h, logits), self.experts.call(program.h, logits, program.out)]
