"""What rank 0 sends the workers: a fixed header, then at most three flat tensors.

    header  int64 [8] on the control group: op, then the sizes that follow (see `Header`)
    ints    int64 [n_ints]: token ids [T], positions [T], slot mapping [T], logit rows [S], then per
            attention group (first_row, B, N, Q, L, causal_from or -1, rotated) and its block table [B * N]
    mask    bool [n_mask]: every group's mask [B, 1, Q, L], flattened, in group order
    floats  model dtype [n_floats]: the key re-rotation (cos, sin) [B, 1, L, D] of groups that have one

A copy-on-write message carries (src, dst) block pairs in `ints`; set-up carries the block count in
the header. The workers rebuild `StepInputs` from these and run the same forward on their shard; the
block ids are rank 0's, and every rank's pools hold their own heads of the same blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvgen.distributed.group import TensorParallelGroup
from kvgen.model.attention import PagedGroup, PagedMetadata
from kvgen.runner.model_runner import StepInputs

HEADER_SIZE = 8
GROUP_FIELDS = 7


class Op(enum.IntEnum):
    SETUP = 1  # header.arg: the number of KV blocks every rank allocates
    STEP = 2
    COPY = 3
    STOP = 4


@dataclass
class Header:
    op: Op
    n_ints: int = 0
    n_mask: int = 0
    n_floats: int = 0
    num_tokens: int = 0
    num_groups: int = 0
    num_logit_rows: int = 0
    arg: int = 0  # SETUP: the number of KV blocks

    def tensor(self) -> torch.Tensor:
        values = [int(self.op), self.n_ints, self.n_mask, self.n_floats, self.num_tokens, self.num_groups,
                  self.num_logit_rows, self.arg]
        return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        v = t.tolist()
        return cls(Op(v[0]), *v[1:8])


@dataclass
class Message:
    header: Header
    ints: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    floats: torch.Tensor | None = None


class StepChannel:
    """Rank 0's `send` and the workers' `receive` of one message, over the group."""

    def __init__(self, group: TensorParallelGroup, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        self.group, self.device, self.dtype, self.head_dim = group, device, dtype, head_dim

    def send(self, message: Message) -> None:
        self.group.broadcast(message.header.tensor(), control=True)
        for part in (message.ints, message.mask, message.floats):
            if part is not None and part.numel():
                self.group.broadcast(part.to(self.device))

    def receive(self) -> Message:
        header = Header.of(self.group.broadcast(torch.zeros(HEADER_SIZE, dtype=torch.int64), control=True))
        parts = []
        for size, dtype in ((header.n_ints, torch.int64), (header.n_mask, torch.bool), (header.n_floats, self.dtype)):
            part = torch.empty(size, dtype=dtype, device=self.device)
            parts.append(self.group.broadcast(part) if size else part)
        return Message(header, *parts)


def encode_step(inputs: StepInputs) -> Message:
    meta = inputs.meta
    ints = [inputs.token_ids, inputs.positions, meta.slot_mapping, inputs.logit_rows]
    masks, floats = [], []
    for g in meta.groups:
        batch, _, num_queries, length = g.mask.shape
        causal_from = -1 if g.causal_from is None else g.causal_from
        fields = [g.first_row, batch, g.kv_blocks.shape[1], num_queries, length, causal_from,
                  int(g.key_rotation is not None)]
        ints += [torch.tensor(fields, device=g.kv_blocks.device), g.kv_blocks.flatten()]
        masks.append(g.mask.flatten())
        if g.key_rotation is not None:
            floats += [t.flatten() for t in g.key_rotation]
    flat_ints = torch.cat([t.to(torch.int64) for t in ints])
    flat_mask = torch.cat(masks)
    flat_floats = torch.cat(floats) if floats else None
    header = Header(Op.STEP, flat_ints.numel(), flat_mask.numel(), 0 if flat_floats is None else flat_floats.numel(),
                    inputs.token_ids.numel(), len(meta.groups), inputs.logit_rows.numel())
    return Message(header, flat_ints, flat_mask, flat_floats)


def decode_step(message: Message, head_dim: int) -> StepInputs:
    h = message.header
    ints, mask, floats = message.ints, message.mask, message.floats
    t, s = h.num_tokens, h.num_logit_rows
    token_ids, positions, slots, logit_rows = ints[:t], ints[t : 2 * t], ints[2 * t : 3 * t], ints[3 * t : 3 * t + s]
    at, mask_at, float_at = 3 * t + s, 0, 0
    groups = []
    for _ in range(h.num_groups):
        first_row, batch, width, num_queries, length, causal_from, rotated = ints[at : at + GROUP_FIELDS].tolist()
        at += GROUP_FIELDS
        kv_blocks = ints[at : at + batch * width].view(batch, width)
        at += batch * width
        size = batch * num_queries * length
        group_mask = mask[mask_at : mask_at + size].view(batch, 1, num_queries, length)
        mask_at += size
        rotation = None
        if rotated:
            n = batch * length * head_dim
            cos, sin = floats[float_at : float_at + n], floats[float_at + n : float_at + 2 * n]
            rotation = (cos.view(batch, 1, length, head_dim), sin.view(batch, 1, length, head_dim))
            float_at += 2 * n
        groups.append(PagedGroup(first_row, kv_blocks, group_mask, None if causal_from < 0 else causal_from, rotation))
    return StepInputs(token_ids, positions, PagedMetadata(slots, groups), logit_rows, [])


def encode_copies(copies: list[tuple[int, int]]) -> Message:
    ints = torch.tensor([b for pair in copies for b in pair], dtype=torch.int64)
    return Message(Header(Op.COPY, n_ints=ints.numel()), ints)


def decode_copies(message: Message) -> list[tuple[int, int]]:
    values = message.ints.tolist()
    return list(zip(values[0::2], values[1::2]))
