"""A mixture of experts in a branch: the router's logits (a linear layer, with a bias where the model
has one), then the routed experts in one C call (kvgen.model.experts; gpt-oss's with biases and the
clamped SwiGLU); where the layer has a shared expert, a gated MLP every token runs, scaled by sigmoid
of its gate's logit, added."""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedMLPSpec, MoESpec
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.blocks.mlp import GatedMLP
from kvgen.model.kernels.build import KernelCall
from kvgen.model.experts import Experts
from kvgen.model.kernels.moe import ExpertOptions
from kvgen.model.linear import Linear


@register(MoESpec.kind)
class MoEBlock(Block):
    kind = MoESpec.kind

    def __init__(self, spec: MoESpec, index: int, ctx: BuildContext) -> None:
        w, build, cfg = ctx.weights, ctx.build, ctx.config
        if build.device.type != "cpu":
            raise ValueError(f"{cfg.architecture}: mixtures of experts run on the CPU only (--device cpu)")
        p = f"model.layers.{index}.{spec.prefix}."
        router_bias = build.float(w[p + spec.router + ".bias"]) if spec.biases else None
        router = w[p + spec.router + ".weight"]
        self.router: Linear = build.unquantized(router, router_bias)  # hidden -> experts
        self.experts = Experts(*(w[p + f"experts.{n}_proj.weight"] for n in ("gate", "up", "down")),
                               top_k=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob,
                               activations=build.activations, options=expert_options(spec, p, ctx),
                               quantization=build.quantization)
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


def expert_options(spec: MoESpec, p: str, ctx: BuildContext) -> ExpertOptions:
    """The experts' biases (fp32, as the kernel adds them) and activation, from the layer's tensors under `p`."""
    cfg, w = ctx.config, ctx.weights
    gate_up_bias = down_bias = None
    if spec.biases:  # [experts, 2 * inner]: each expert's gate biases, then its up biases, as its stacked rows
        gate_up_bias = torch.cat([w[p + f"experts.{n}_proj.bias"].float() for n in ("gate", "up")], dim=1).contiguous()
        down_bias = w[p + "experts.down_proj.bias"].float().contiguous()  # [experts, hidden]
    return ExpertOptions(gate_up_bias, down_bias, spec.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
