"""A step's view of the state pool for the recurrent layers (kvgen.model.blocks.base.StateBatch):
each sequence's slot and rows, in the order the runner laid the step out.

    rows        [ d0 d1 d2 | v0 v0 v0 | p0 p0 p0 p0 p0 ]     decodes, verify chunks, prompt chunks
    slots       [  4  0  7 |    2     |       5        ]     one per sequence
    verify_rows [  -  -  - |    0     |       -        ]     a checkpoint row per verify chunk

The decodes come first, then the verify chunks, then the prompt chunks (ModelRunner.prepare lays them
out so), so that a recurrent layer runs the decodes as one batch over rows 0..num_decodes - 1 and the
prompt chunks as one ragged batch over the last rows. A chunk of one token that is not a verify chunk is a decode
whatever it is (the last token of a prompt is one step of the recurrence from the slot's state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.cache.state_pool import StatePool
from kvgen.scheduling.output import ScheduledChunk


@dataclass
class StepStates:
    """StateBatch over a StatePool whose layer i is model layer `layers[i]`."""

    pool: StatePool
    pool_index: dict[int, int]  # model layer -> its layer in the pool
    slots: torch.Tensor  # [B] int64
    row_starts: list[int]  # [B + 1]
    num_decodes: int
    verify_rows: list[int | None]  # [B]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.layer(self.pool_index[index])

    def checkpoints(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.checkpoints(self.pool_index[index])


def step_states(pool: StatePool, layers: tuple[int, ...], ordered: list[ScheduledChunk]) -> StepStates:
    """The StateBatch of a step whose chunks run in `ordered`'s order (their sequences hold slots)."""
    row_starts, slots, verify_rows = [0], [], []
    for chunk in ordered:
        if chunk.seq.state_slot is None:
            raise RuntimeError(f"sequence {chunk.seq.seq_id} runs without a state slot")
        slots.append(chunk.seq.state_slot)
        row_starts.append(row_starts[-1] + chunk.num_tokens)
        verify_rows.append(chunk.verify_row if chunk.draft else None)
    num_decodes = next((i for i, c in enumerate(ordered) if c.num_tokens > 1 or c.draft), len(ordered))
    kinds = [bool(c.draft) for c in ordered[num_decodes:]]
    if kinds != sorted(kinds, reverse=True):
        raise ValueError("a step's rows run decodes, then verify chunks, then prompt chunks")
    return StepStates(pool, {layer: i for i, layer in enumerate(layers)}, torch.tensor(slots, dtype=torch.int64),
                      row_starts, num_decodes, verify_rows)
