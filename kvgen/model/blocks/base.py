"""The block interface, the contexts a block is built and run with, and the registry of block kinds.

See the package docstring (kvgen.model.blocks) for how a block is added and how it meets the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from kvgen.architectures.spec import BlockSpec
from kvgen.config import ModelConfig
from kvgen.model.attention import Attention
from kvgen.model.kernels.build import KernelCall
from kvgen.model.layers import Norm, Rotate
from kvgen.model.linear import Linear, RowKernels

if TYPE_CHECKING:
    from kvgen.model.linear_choice import LayerBuilder, Weight


class StateBatch(Protocol):
    """A step's view of the per-sequence state pool, for blocks with a recurrent state (Qwen3.5's
    Gated DeltaNet). The runner fills it beside the paged-KV metadata (kvgen.runner.state_batch):
    the first `num_decodes` sequences have one row each (rows 0..num_decodes - 1, run as one batch),
    then come the speculative verify chunks (where `verify_rows[b]` is set: the state after each
    position goes to that checkpoint row and not to the slot), then the prompt chunks."""

    pool: object  # the pool the slots index (kvgen.cache.state_pool.StatePool): a fused step's calls point into it
    slots: torch.Tensor  # [B] int64: each sequence's state slot in the pool, in batch order
    row_starts: list[int]  # [B + 1]: sequence b owns rows row_starts[b]:row_starts[b + 1]
    num_decodes: int
    verify_rows: list[int | None]  # [B]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer `index`'s pool rows: conv windows [slots, conv_dim, K - 1], states [slots, Hv, Dk, Dv]."""

    def checkpoints(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Its verify checkpoints: conv [rows, positions, conv_dim, K - 1], states [rows, positions, Hv, Dk, Dv]."""


@dataclass
class StepContext:
    """What a block reads besides its input rows, one per forward call."""

    positions: torch.Tensor  # [T] each row's position in its sequence
    tables: list[tuple[torch.Tensor, torch.Tensor]]  # per RoPE base: cos, signed sin [T, 1, D]
    attention: Attention  # paged (or contiguous) KV: attention(layer, q, k, v) stores and attends
    rows: RowKernels | None = None  # each row's matmul kernel by role (kvgen.model.linear)
    states: StateBatch | None = None  # recurrent blocks' state slots (None: the model has none)
    per_layer_inputs: torch.Tensor | None = None  # [T, layers, P] Gemma 4's (kvgen.model.blocks.per_layer_input)


@dataclass
class BuildContext:
    """What a block is built from: the config, the weights by HF name, the linear-layer builder, the
    model's norm and RoPE kernels, and each layer's RoPE table index."""

    config: ModelConfig
    weights: Mapping[str, Weight]
    build: LayerBuilder
    norm: Norm
    rotate: Rotate
    rope_index: Callable[[int], int]


class FusedProgram(Protocol):
    """What a block's fused form writes into (kvgen.model.fused.ProgramBuilder)."""

    rows: int
    h: torch.Tensor  # [rows, hidden] the branch's input: its normed x (x itself where the branch has no norm)
    out: torch.Tensor  # [rows, hidden] where the block's output goes
    step: object  # kvgen.model.kernels.step.StepKernels
    norm: object  # kvgen.model.kernels.norm.RmsNorm
    rope: object  # kvgen.model.kernels.rope.Rope
    # The step's state slots where every row is a decode (a verify chunk's states go to checkpoints,
    # which no call writes: with one, or without a state pool, None and recurrent blocks run layer by
    # layer); state_slots [rows] int64, each row's slot, copied in every step.
    states: StateBatch | None
    state_slots: torch.Tensor | None

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A [rows, *shape] buffer of the model's dtype, shared by every block asking the same."""

    def rope_tables(self, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos, signed sin rows [rows, 1, D] of RoPE base `rope`."""

    def attend_calls(self, layer: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> list[KernelCall] | None:
        """Store k/v [rows, kv_heads, D] in layer's pools, attend queries [rows, heads, D] into out."""

    def attend_cached_calls(self, layer: int, queries: torch.Tensor, out: torch.Tensor) -> list[KernelCall]:
        """Attend queries [rows, heads, D] over layer's pools as they are (its K/V of this step stored
        by an earlier call) into out."""


class Block(ABC):
    """A runnable block: one residual branch's work between its norm and its residual add."""

    kind: ClassVar[str]

    @abstractmethod
    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        """h [T, hidden] (the normed residual stream) -> the branch output [T, hidden], a fresh tensor."""

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        """The block's forward as C kernel calls from program.h into program.out (the same kernels,
        the same bits), or None where it has no fused form: its layer then runs layer by layer."""
        return None

    def reserve_buffers(self, program: FusedProgram) -> None:
        """Asks `program` for the buffers `fused_calls` will use, before the calls are built, so that
        the step's buffers lie together in memory (kvgen.model.fused.ProgramBuilder)."""

    def projections(self) -> dict[str, Linear]:
        """Its linear layers by role (`qkv`, `o`, `gate_up`, `down`), for reports and tensor parallelism."""
        return {}

    @classmethod
    def fuses(cls) -> bool:
        return cls.fused_calls is not Block.fused_calls


BlockBuilder = Callable[[BlockSpec, int, BuildContext], Block]
BLOCKS: dict[str, BlockBuilder] = {}  # spec kind -> builder (a Block class taking (spec, layer, context))


def register(kind: str) -> Callable[[BlockBuilder], BlockBuilder]:
    """Registers the block that runs specs of `kind` (kvgen.architectures.spec.BlockSpec.kind)."""

    def add(builder: BlockBuilder) -> BlockBuilder:
        if kind in BLOCKS:
            raise ValueError(f"block kind {kind!r} is registered twice")
        BLOCKS[kind] = builder
        return builder

    return add


def build_block(spec: BlockSpec, index: int, context: BuildContext) -> Block:
    """The runnable block for a description's block spec, in layer `index`."""
    builder = BLOCKS.get(spec.kind)
    if builder is None:
        raise ValueError(f"block kind {spec.kind!r} has no implementation in kvgen.model.blocks "
                         f"(known: {', '.join(sorted(BLOCKS))})")
    return builder(spec, index, context)
