"""Reads and writes one block's K/V bytes, every layer, out of and into the paged pools, in the pools'
own dtype (int8 / fp8 pools with their float32 scales), or quantized to int8 (`Int8PoolIO`). Duck-typed over the pools (`k`, `v`, `k_scale`,
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
        stacked, ids = self._stacked(block_ids, payloads, self.rows[0].device)  # [n, block_bytes], [n]
        n, bs = len(block_ids), self.block_size
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
        self.write_many([block_id], [payload])

    def _stacked(self, block_ids: list[int], payloads: list[torch.Tensor],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The payloads as one [n, block_bytes] tensor on the pools' device, and the block ids beside them."""
        if any(p.numel() != self.block_bytes for p in payloads):
            raise ValueError(f"a block payload is not the {self.block_bytes} bytes a tier block takes here")
        return torch.stack(payloads).to(device), torch.tensor(block_ids, device=device)


class Int8PoolIO(PoolIO):
    """`--kv-offload-dtype int8`: a float pool's blocks stored in the tiers as int8 with one float32
    scale per row (one token's K, or V, of one head: max |x| / 127), about a quarter of fp32's bytes.
    Each part of the payload is [kv_heads, block_size, head_dim] int8, then [kv_heads, block_size]
    float32 scales. Restored values are within scale / 2 = max|row| / 254 of the pool's (plus the
    rounding to a 16-bit pool's dtype)."""

    def __init__(self, cache: object) -> None:
        if getattr(cache, "quantized", False):
            raise ValueError("--kv-offload-dtype int8 is for float KV pools: an int8 / fp8 pool's blocks go "
                             "to the tiers as they are")
        self.tensors = [t for layer in range(len(cache.k)) for t in (cache.k[layer], cache.v[layer])]
        self.block_size = cache.block_size
        self.parts = [t.shape[0] * self.block_size * (t.shape[2] + 4) for t in self.tensors]
        self.block_bytes = sum(self.parts)

    def read(self, block_id: int) -> torch.Tensor:
        lo, hi = block_id * self.block_size, (block_id + 1) * self.block_size
        out = torch.empty(self.block_bytes, dtype=torch.uint8)
        at = 0
        for t, size in zip(self.tensors, self.parts):
            rows = t[:, lo:hi].float()  # [H, block_size, D]
            scale = rows.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
            values = (rows / scale).round_().clamp_(-127, 127).to(torch.int8).cpu()
            nq = values.numel()
            out[at:at + nq].copy_(values.reshape(-1).view(torch.uint8))
            out[at + nq:at + size].copy_(scale.reshape(-1).cpu().view(torch.uint8))
            at += size
        return out

    def write_many(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Dequantizes payloads of `read` into many blocks: one indexed store per pool tensor."""
        if not block_ids:
            return
        stacked, ids = self._stacked(block_ids, payloads, self.tensors[0].device)  # [n, block_bytes], [n]
        n, bs = len(block_ids), self.block_size
        at = 0
        for t, size in zip(self.tensors, self.parts):
            heads, dim = t.shape[0], t.shape[2]
            nq = heads * bs * dim
            values = stacked[:, at:at + nq].view(torch.int8).reshape(n, heads, bs, dim)
            scale = stacked[:, at + nq:at + size].contiguous().view(torch.float32).reshape(n, heads, bs, 1)
            blocks = t.view(heads, -1, bs, dim)  # [H, num_blocks + 1, block_size, D]
            blocks[:, ids] = (values.float() * scale).to(t.dtype).transpose(0, 1)
            at += size
