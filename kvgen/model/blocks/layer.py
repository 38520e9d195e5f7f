"""A decoder layer as its architecture composes it: residual branches, each
`x += out_norm(block(norm(x)))`, run in order on the residual stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.architectures.spec import LayerSpec
from kvgen.model.blocks.base import Block, BuildContext, StepContext, build_block
from kvgen.model.layers import Norm
from kvgen.model.linear import Linear


@dataclass
class Branch:
    """Norm weights are the factors the norm multiplies by (Gemma's 1 + w already added)."""

    norm: torch.Tensor | None  # [hidden] before the block (None: the block reads x itself)
    block: Block
    out_norm: torch.Tensor | None = None  # [hidden] on the block's output, before the residual add (Gemma)


class DecoderLayer:
    """One layer: its branches (attention then MLP, for every architecture kvgen runs today)."""

    def __init__(self, index: int, branches: list[Branch], eps: float, norm: Norm,
                 scalar: torch.Tensor | None = None) -> None:
        """`scalar` [1]: what the residual stream is multiplied by after the branches (Gemma 4)."""
        self.index, self.branches, self.eps, self._norm, self.scalar = index, branches, eps, norm, scalar

    @classmethod
    def build(cls, spec: LayerSpec, index: int, ctx: BuildContext) -> DecoderLayer:
        p = f"model.layers.{index}."

        def norm(name: str | None) -> torch.Tensor | None:
            return ctx.build.float(ctx.weights[p + name + ".weight"]) if name else None

        branches = [Branch(norm(b.norm), build_block(b.block, index, ctx), norm(b.out_norm)) for b in spec.branches]
        scalar = ctx.build.float(ctx.weights[p + spec.scalar]) if spec.scalar else None
        return cls(index, branches, ctx.config.rms_norm_eps, ctx.norm, scalar)

    @property
    def blocks(self) -> list[Block]:
        return [branch.block for branch in self.branches]

    def projections(self) -> dict[str, Linear]:
        """Every block's linear layers by role (`qkv`, `o`, `gate_up`, `down`)."""
        return {role: linear for block in self.blocks for role, linear in block.projections().items()}

    def __getattr__(self, role: str) -> Linear:
        """`layer.qkv`, `layer.down`, ...: the projection of that role (for reports and tests)."""
        if role.startswith("_") or role in ("branches", "index", "eps", "scalar"):
            raise AttributeError(role)
        projections = self.projections()
        if role not in projections:
            raise AttributeError(f"layer {self.index} has no attribute or projection {role!r}")
        return projections[role]

    def fuses(self) -> bool:
        """Every block has a fused form (kvgen.model.fused)."""
        return all(block.fuses() for block in self.blocks)

    def forward(self, x: torch.Tensor, step: StepContext) -> None:
        """x [T, hidden], the residual stream, updated in place."""
        for branch in self.branches:
            out = branch.block.forward(x if branch.norm is None else self._norm(x, branch.norm, self.eps), step)
            x.add_(out if branch.out_norm is None else self._norm(out, branch.out_norm, self.eps))
        if self.scalar is not None:
            x.mul_(self.scalar)
