"""Blocks: the runnable pieces a decoder layer is composed of, built from kvgen.architectures' descriptions.

A layer is a list of residual branches, `x += out_norm(block(norm(x)))` (kvgen.model.blocks.layer);
an architecture's description says which block each branch holds, layer by layer, so the layers of
one model may differ (Gemma 3's window and global attention today; Qwen3.5's delta-net and attention
layers next). The blocks, each a module of this package:

    attention   q/k/v (fused, biases), QK-norm, RoPE of the layer's base, paged KV via the backend, o
    gated_mlp   down(act(gate) * up), SwiGLU or GeGLU
    embedding   the token embedding, times sqrt(hidden) where the architecture scales it
    gated_attention   attention whose q projection carries a sigmoid output gate, partial RoPE (Qwen3.5)
    gated_delta_net   linear attention over a recurrent state per sequence, in the state pool (Qwen3.5)

The interface (kvgen.model.blocks.base.Block):

    forward(h, step) -> out          h [T, hidden] normed rows -> [T, hidden]; `step` (StepContext)
                                     carries positions, RoPE tables, the attention backend, row kernels
                                     and the recurrent state batch
    fused_calls(program) -> calls    the same work as C kernel calls for the fused decode step
                                     (kvgen.model.fused), or None: the layer then runs layer by layer
                                     inside the fused step, correctly, and the model says so at start-up
    projections() -> {role: Linear}  for the weights report and tensor parallelism

Adding a block (mixture of experts, gated delta net, shared-KV attention):
1. a spec in kvgen/architectures/spec.py: a frozen dataclass subclassing BlockSpec with its `kind`,
   its options and `tensors(config)` (names under the layer and shapes, which the loaders check);
2. a module here with a Block subclass decorated `@register("<kind>")`, built as
   `Cls(spec, layer_index, BuildContext)`: every module of this package is imported, so registering
   is all it takes; `fused_calls` is optional.
An architecture using it then names the spec in its branches (kvgen/architectures/<name>.py).

Where the blocks of the next issues meet the cache:
- KV: an attention block hands q, k, v to `step.attention(layer, q, k, v)`, which stores the layer's
  K/V in its paged pools and attends. A shared-KV block (Gemma 4) will read a donor layer's K/V
  instead: the backend learns `attend(donor, q)` (no store) and the cache allocates no pools for
  the sharing layer.
- State: a recurrent block (Gated DeltaNet) owns per-sequence state instead of KV blocks. The runner
  passes `step.states` (StateBatch): one state slot index per sequence in the batch (`slots` [B])
  and each sequence's rows (`row_starts` [B + 1]); `states.layer(i)` gives the block its pool
  tensors (conv window, recurrent state) to read at `slots` and write back after the step.
- A mixture of experts replaces `gated_mlp` in a branch; its router and experts are one block.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvgen.model.blocks.base import BLOCKS, Block, BuildContext, StateBatch, StepContext, build_block, register

__all__ = ["BLOCKS", "Block", "BuildContext", "StateBatch", "StepContext", "build_block", "register"]

for _module in pkgutil.iter_modules(__path__):  # each module registers its blocks
    importlib.import_module(f"{__name__}.{_module.name}")

