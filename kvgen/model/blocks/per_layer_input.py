"""Gemma 4's per-layer inputs (E2B/E4B): beside the residual stream, each layer gets a small vector
per token, made once per step for every layer from the token (a table of its own) and from its
embedding (a projection), and adds it through a gated branch of its own.

    inputs [T, L, P] = (rms_norm(project(x0) / sqrt(hidden)) + table[token] * sqrt(P)) / sqrt(2)
    layer i:   x += out_norm(proj(gelu_tanh(gate(x)) * inputs[:, i]))      (no norm before the gate)

The inputs are made before the layers (in Python; kvgen.model.decoder); a fused decode step copies
them into a buffer of its own and runs each layer's branch from it as three calls (gate, the GeGLU
kernel of the gated MLP, proj).

x0 are the scaled token embeddings, L the layers, P `per_layer_input_size`. The numerics follow
transformers' Gemma4TextModel op for op (its scales are Python floats, as here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvgen.architectures.spec import PerLayerInputSpec
from kvgen.config import ModelConfig
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.blocks.embedding import embed
from kvgen.model.kernels.build import KernelCall
from kvgen.model.layers import Norm, make_gate_pair_mul
from kvgen.model.linear import Linear, RowKernels
from kvgen.model.linear_choice import Embedding, LayerBuilder, Weight

INPUT_SCALE = 2.0**-0.5  # the two parts are averaged in RMS: (projection + token) / sqrt(2)
BUFFER = "per_layer_inputs"  # a fused step's copy of the step's inputs [rows, L, P] (kvgen.model.fused)


class PerLayerInputs:
    """The step's per-layer inputs for every layer: token_ids [T], x0 [T, hidden] -> [T, L, P]."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], build: LayerBuilder, norm: Norm) -> None:
        self.layers, self.width, self.eps, self._norm = config.num_layers, config.per_layer_input_size, \
            config.rms_norm_eps, norm
        self.table = Embedding(weights["model.embed_tokens_per_layer.weight"], build)  # [V', L * P]
        self.table_scale = torch.tensor(math.sqrt(self.width)).to(build.dtype).item()
        self.projection: Linear = build.linear([weights["model.per_layer_model_projection.weight"]])  # -> L * P
        self.projection_scale = config.hidden_size**-0.5
        self.projection_norm = build.float(weights["model.per_layer_projection_norm.weight"])  # [P]

    def __call__(self, token_ids: torch.Tensor, x0: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        tokens = embed(self.table, self.table_scale, token_ids).view(-1, self.layers, self.width)
        projected = self.projection(x0, rows) * self.projection_scale
        projected = self._norm(projected.view(-1, self.width), self.projection_norm, self.eps)
        return (projected.view(-1, self.layers, self.width) + tokens) * INPUT_SCALE


@register(PerLayerInputSpec.kind)
class PerLayerInputBlock(Block):
    """Layer `index`'s branch over its slice of `step.per_layer_inputs`."""

    kind = PerLayerInputSpec.kind

    def __init__(self, spec: PerLayerInputSpec, index: int, ctx: BuildContext) -> None:
        if spec.activation != "gelu_tanh":
            raise ValueError(f"per-layer input with activation {spec.activation!r} is not supported")
        p = f"model.layers.{index}."
        self.index = index
        self.gate: Linear = ctx.build.linear([ctx.weights[p + "per_layer_input_gate.weight"]])  # hidden -> P
        self.proj: Linear = ctx.build.linear([ctx.weights[p + "per_layer_projection.weight"]])  # P -> hidden
        self.layers, self.width = ctx.config.num_layers, ctx.config.per_layer_input_size
        self.activation = spec.activation
        self.gate_mul = make_gate_pair_mul(spec.activation, ctx.build.device, ctx.build.dtype)

    def projections(self) -> dict[str, Linear]:
        return {"per_layer_gate": self.gate, "per_layer_proj": self.proj}

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        if step.per_layer_inputs is None:
            raise ValueError("a per-layer input block needs the step's per-layer inputs")
        gated = self.gate_mul(self.gate(h, step.rows), step.per_layer_inputs[:, self.index])  # [T, P]
        return self.proj(gated, step.rows)

    def reserve_buffers(self, program: FusedProgram) -> None:
        program.buffer(BUFFER, (self.layers, self.width))
        program.buffer("per_layer_gate", (self.width,)), program.buffer("per_layer_act", (self.width,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None]:
        inputs = program.buffer(BUFFER, (self.layers, self.width))[:, self.index]  # [rows, P], rows L * P apart
        gate, act = program.buffer("per_layer_gate", (self.width,)), program.buffer("per_layer_act", (self.width,))
        return [self.gate.call(program.h, gate), program.step.gate_pair_mul_call(self.activation, gate, inputs, act),
                self.proj.call(act, program.out)]
