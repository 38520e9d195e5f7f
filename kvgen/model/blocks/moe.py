"""A mixture of experts in a branch: the router's logits (a linear layer), then the routed experts in
one C call (kvgen.model.experts)."""

from __future__ import annotations

import torch

from kvgen.architectures.spec import MoESpec
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.kernels.build import KernelCall
from kvgen.model.experts import Experts
from kvgen.model.linear import Linear


@register(MoESpec.kind)
class MoEBlock(Block):
    kind = MoESpec.kind

    def __init__(self, spec: MoESpec, index: int, ctx: BuildContext) -> None:
        w, build, cfg = ctx.weights, ctx.build, ctx.config
        p = f"model.layers.{index}.{spec.prefix}."
        self.router: Linear = build.linear([w[p + "gate.weight"]])  # hidden -> experts
        self.experts = Experts(*(w[p + f"experts.{n}_proj.weight"] for n in ("gate", "up", "down")),
                               top_k=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob,
                               activations=build.activations)

    def projections(self) -> dict[str, Linear]:
        return {"router": self.router}

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        logits = self.router(h, step.rows).float()
        return self.experts(h.float(), logits).to(h.dtype)

    def reserve_buffers(self, program: FusedProgram) -> None:
        program.buffer("router_logits", (self.experts.num_experts,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        """The router's call and the experts' (fp32 steps: the expert kernel reads and writes fp32)."""
        if program.h.dtype != torch.float32:
            return None
        logits = program.buffer("router_logits", (self.experts.num_experts,))
        return [self.router.call(program.h, logits), self.experts.call(program.h, logits, program.out)]
