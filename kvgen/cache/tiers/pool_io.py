"""Reads and writes one block's K/V bytes, every layer, out of and into the paged pools, in the pools'
own dtype (int8 / fp8 pools with their float32 scales). Duck-typed over the pools (`k`, `v`, `k_scale`,
`v_scale` lists of per-layer tensors [kv_heads, num_slots, ...], `quantized`, `block_size`) so that the
cache layer needs nothing of the model's module layout.

A block's payload, one flat uint8 buffer:  [ K l0 | V l0 | (K scales l0 | V scales l0) | K l1 | ... ]
each part the block's slots of that tensor, [kv_heads, block_size, row bytes].
"""

from __future__ import annotations

import torch


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor [H, S, ...] as its bytes [H, S, row bytes] (a view)."""
    if t.dim() == 2:
        t = t.unsqueeze(-1)
    return t.view(torch.uint8)


class PoolIO:
    """Copies whole blocks between the pools and flat CPU byte buffers."""

    def __init__(self, cache: object) -> None:
        tensors: list[torch.Tensor] = []
        for layer in range(len(cache.k)):
            tensors += [cache.k[layer], cache.v[layer]]
            if getattr(cache, "quantized", False):
                tensors += [cache.k_scale[layer], cache.v_scale[layer]]
        self.rows = [_as_rows(t) for t in tensors]
        self.block_size = cache.block_size
        self.parts = [r.shape[0] * self.block_size * r.shape[2] for r in self.rows]
        self.block_bytes = sum(self.parts)

    def read(self, block_id: int) -> torch.Tensor:
        """The block's payload: a new CPU uint8 tensor of `block_bytes`."""
        lo, hi = block_id * self.block_size, (block_id + 1) * self.block_size
        out = torch.empty(self.block_bytes, dtype=torch.uint8)
        at = 0
        for rows, size in zip(self.rows, self.parts):
            out[at:at + size].view(rows.shape[0], self.block_size, rows.shape[2]).copy_(rows[:, lo:hi])
            at += size
        return out

    def write_many(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Stores payloads of `read` into many blocks: one indexed copy per pool tensor (whole block rows,
        as 8-byte words where a row allows)."""
        if not block_ids:
            return
        if any(p.numel() != self.block_bytes for p in payloads):
            raise ValueError(f"a block payload is not the pools' {self.block_bytes} bytes a block")
        device = self.rows[0].device
        stacked = torch.stack(payloads).to(device)  # [n, block_bytes]
        n, bs = len(block_ids), self.block_size
        ids = torch.tensor(block_ids, device=device)
        at = 0
        for rows, size in zip(self.rows, self.parts):
            heads, width = rows.shape[0], rows.shape[2]
            word = torch.int64 if (bs * width) % 8 == 0 else torch.uint8
            blocks = rows.view(heads, -1, bs * width).view(word)  # [H, num_blocks + 1, block row]
            part = stacked[:, at:at + size].view(n, heads, bs * width).view(word)
            blocks[:, ids] = part.transpose(0, 1)
            at += size

    def write(self, block_id: int, payload: torch.Tensor) -> None:
        """Stores a payload of `read` into the block's slots in every pool."""
        if payload.numel() != self.block_bytes:
            raise ValueError(f"block payload of {payload.numel()} bytes, the pools' blocks take {self.block_bytes}")
        lo, hi = block_id * self.block_size, (block_id + 1) * self.block_size
        at = 0
        for rows, size in zip(self.rows, self.parts):
            rows[:, lo:hi].copy_(payload[at:at + size].view(rows.shape[0], self.block_size, rows.shape[2]))
            at += size
