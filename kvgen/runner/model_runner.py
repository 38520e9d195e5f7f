"""Turns a schedule into tensors, runs the model once over the ragged batch, returns logits.

The flat batch puts decode tokens first, then prefill chunks:

    rows       [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 | pad ]      T rows, one forward pass
    groups       decodes: 3 x 1 query          prefills: 2 x 4 queries (padded); one SDPA call each
    slots      where each token's K/V go: block_table[pos // block_size] * block_size + pos % block_size

Per-step metadata is built once here and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvgen.engine.scheduler import ScheduledChunk
from kvgen.model.attention import PagedAttention, PagedGroup, PagedKVCache, PagedMetadata
from kvgen.model.llama import LlamaModel


class BlockTables(Protocol):
    def block_table(self, seq_id: int) -> list[int]: ...


def batch_invariant_size(num_tokens: int) -> int:
    """Rows to run for `num_tokens` so that each row's matmul result does not depend on the batch.

    CPU GEMM kernels (MKL) take other code paths for 1-3, 5-7 and 9-11 rows, which round
    differently; padding to a multiple of 4 below 12 rows keeps every row bit-identical to the
    same row in any larger batch. A determinism choice: a request's tokens must not depend on
    what else runs beside it.
    """
    return num_tokens if num_tokens >= 12 else -(-num_tokens // 4) * 4


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [T] (T >= real tokens: padded)
    positions: torch.Tensor  # [T]
    meta: PagedMetadata
    sample_rows: torch.Tensor  # [S] rows whose hidden states give logits, in the chunks' given order


class ModelRunner:
    """Owns the model and the KV pools; knows tensors, not requests or queues."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, block_tables: BlockTables,
                 sliding_window: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.block_tables = block_tables
        self.sliding_window = sliding_window
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs one step; returns fp32 logits [S, vocab] for the chunks that complete their sequence,
        in the order they appear in `chunks`."""
        inputs = self.prepare(chunks)
        hidden = self.model.forward(inputs.token_ids, inputs.positions, PagedAttention(self.cache, inputs.meta))
        return self.model.logits(hidden[inputs.sample_rows])

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Orders the chunks (decodes, then prefills) and builds every tensor of the step."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        num_real = sum(c.num_tokens for c in ordered)
        num_rows = batch_invariant_size(num_real)
        groups: list[PagedGroup] = []
        slots, out_index, positions = [], [], []
        first_row, out_base = 0, 0
        for group_chunks in (decodes, prefills):
            if group_chunks:
                built = self._group(group_chunks, first_row, num_rows, out_base)
                groups.append(built.group)
                slots.append(built.slots)
                out_index.append(built.out_index)
                positions.append(built.positions)
                first_row += built.slots.numel()
                out_base += built.group.token_index.numel()
        pad = num_rows - num_real
        token_ids = [t for c in ordered for t in c.seq.token_ids[c.start : c.start + c.num_tokens]] + [0] * pad
        meta = PagedMetadata(
            slot_mapping=self._padded(slots, pad, self.cache.scratch_slot),
            groups=groups,
            out_index=self._padded(out_index, pad, 0),
        )
        rows = {id(c): r for c, r in zip(ordered, _last_rows(ordered))}
        sample_rows = [rows[id(c)] for c in chunks if c.completes_sequence]
        return StepInputs(
            token_ids=torch.tensor(token_ids, device=self.device),
            positions=self._padded(positions, pad, 0),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, device=self.device, dtype=torch.long),
        )

    def _group(self, chunks: list[ScheduledChunk], first_row: int, num_rows: int, out_base: int) -> "_BuiltGroup":
        """One SDPA group: queries padded to [B, Qmax], keys read through padded block tables [B, L]."""
        device, block_size = self.device, self.cache.block_size
        n = torch.tensor([c.num_tokens for c in chunks], device=device)  # [B]
        start = torch.tensor([c.start for c in chunks], device=device)  # [B]
        q_max = int(n.max())
        i = torch.arange(q_max, device=device)
        is_query = i[None, :] < n[:, None]  # [B, Qmax]
        rows = first_row + torch.cumsum(n, 0)[:, None] - n[:, None] + i[None, :]
        token_index = torch.where(is_query, rows, num_rows)  # row num_rows is the zero query
        q_pos = start[:, None] + i[None, :]  # [B, Qmax]
        tables = self._block_tables(chunks)  # [B, num_blocks]
        kv_slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # [B, L]
        k_pos = torch.arange(kv_slots.shape[1], device=device)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, L]
        if self.sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        mask &= is_query[:, :, None]
        mask[:, :, 0] |= ~is_query  # padding queries look at one key, so no row is all -inf
        slots = kv_slots.gather(1, q_pos.clamp(max=kv_slots.shape[1] - 1))[is_query]
        out_index = (out_base + torch.arange(len(chunks), device=device)[:, None] * q_max + i[None, :])[is_query]
        return _BuiltGroup(PagedGroup(token_index, kv_slots, mask[:, None]), slots, out_index, q_pos[is_query])

    def _block_tables(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """[B, max blocks needed] block ids; unused entries and freed (null, < 0) blocks -> scratch."""
        block_size, scratch = self.cache.block_size, self.cache.num_blocks
        needed = [-(-(c.start + c.num_tokens) // block_size) for c in chunks]
        width = max(needed)
        padded = []
        for c, k in zip(chunks, needed):
            table = self.block_tables.block_table(c.seq.seq_id)[:k]
            padded.append([b if b >= 0 else scratch for b in table] + [scratch] * (width - k))
        return torch.tensor(padded, device=self.device)

    def _padded(self, parts: list[torch.Tensor], pad: int, value: int) -> torch.Tensor:
        return torch.cat(parts + [torch.full((pad,), value, device=self.device, dtype=torch.long)])


@dataclass
class _BuiltGroup:
    group: PagedGroup
    slots: torch.Tensor  # [tokens in group]
    out_index: torch.Tensor  # [tokens in group]
    positions: torch.Tensor  # [tokens in group]


def _last_rows(ordered: list[ScheduledChunk]) -> list[int]:
    """Flat row of each chunk's last token."""
    rows, end = [], 0
    for c in ordered:
        end += c.num_tokens
        rows.append(end - 1)
    return rows
