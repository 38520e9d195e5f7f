"""KV storage: the tensors a layer's K/V live in, apart from the attention backends that read them
(kvgen.model.attention).

    ContiguousKVCache  one sequence, [batch, kv_heads, max_seq, head_dim] per layer
    PagedKVCache       a block pool per layer, [kv_heads, num_blocks * block_size, head_dim], in the
                       model's dtype or quantized (int8 / fp8 with scales, kvgen.model.kv_quant)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvgen.loaders.residency import untouched_zeros
from kvgen.model.kv_quant import as_bytes, dequantize, is_quantized, key_groups, quantize


class ContiguousKVCache:
    """Per layer K and V of shape [batch, kv_heads, max_seq, head_dim], preallocated; batch is 1 here."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq: int,
                 device: torch.device, dtype: torch.dtype,
                 layer_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """`layer_shapes`: (kv_heads, head_dim) per layer where they differ (Gemma 4)."""
        shapes = [(1, heads, max_seq, dim) for heads, dim in layer_shapes or [(num_kv_heads, head_dim)] * num_layers]
        self.k = [_zeros(shape, device, dtype) for shape in shapes]
        self.v = [_zeros(shape, device, dtype) for shape in shapes]
        self.length = 0  # tokens stored so far

    @property
    def max_seq(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A pool's zeros: on the CPU in pages that take memory as the pool fills (see untouched_zeros)."""
    if torch.device(device).type == "cpu":
        return untouched_zeros(shape, dtype)
    return torch.zeros(shape, device=device, dtype=dtype)


class PagedKVCache:
    """The K/V pools: per layer [kv_heads, num_slots, head_dim], slot = block * block_size + offset.

    Heads come first so that gathering a sequence's blocks yields each head's keys as one run of
    [L, head_dim], the layout SDPA reads fastest (no transposing copy). One extra block at the end is
    scratch space: sequences shorter than the longest of their group read it as padding (always
    masked out), so the hot path needs no conditionals.

    The pools hold `dtype` (the model's by default). A quantized pool (int8, fp8) also holds float32
    scales, indexed by slot like the values, so a block carries its scales wherever it is copied or
    shared: `k_scale` [kv_heads, num_slots, key_groups(D)] (one per 16 dimensions of a key: keys have
    outlier channels; [kv_heads, num_slots] where key_groups is 1) and `v_scale` [kv_heads, num_slots]
    (one per value row). Writes quantize; reads
    (gather, the decode kernel) dequantize to `compute_dtype`. A float pool of another dtype than
    the model's (bf16 / fp16 pools under an fp32 model: half the bytes a token) is the same rule
    without scales: writes round to the pool's dtype, reads widen back to `compute_dtype`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> None:
        num_slots = (num_blocks + 1) * block_size
        shape = (num_kv_heads, num_slots, head_dim)
        self.k = [_zeros(shape, device, dtype) for _ in range(num_layers)]
        self.v = [_zeros(shape, device, dtype) for _ in range(num_layers)]
        self.quantized = is_quantized(dtype)
        self.compute_dtype = compute_dtype or dtype
        self.key_groups = key_groups(head_dim)
        scales = (num_kv_heads, num_slots) if self.quantized else (0, 0)
        k_scales = (*scales, self.key_groups) if self.key_groups > 1 else scales
        self.k_scale = [_zeros(k_scales, device, torch.float32) for _ in range(num_layers)]
        self.v_scale = [_zeros(scales, device, torch.float32) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Reused by every gather: fresh multi-MB buffers each layer cost more in page faults than the copy.
        self._gathered_k = torch.empty(0, device=device, dtype=dtype)
        self._gathered_v = torch.empty(0, device=device, dtype=dtype)
        # The same for a float pool's gathered copy widened to compute_dtype (see `_converted`).
        self._converted_k = torch.empty(0, device=device, dtype=self.compute_dtype)
        self._converted_v = torch.empty(0, device=device, dtype=self.compute_dtype)

    @property
    def converts(self) -> bool:
        """Whether a float pool holds another dtype than the model computes in: gathered copies are
        converted to compute_dtype (the decode kernel and the store convert in C)."""
        return not self.quantized and self.k[0].dtype != self.compute_dtype

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool of one layer viewed as [kv_heads, num_blocks + 1, block_size, head_dim] (fp8 pools
        as their bytes: torch's CPU copies and gathers do not take fp8)."""
        kv_heads, _, head_dim = self.k[layer].shape
        shape = (kv_heads, -1, self.block_size, head_dim)
        return as_bytes(self.k[layer]).view(shape), as_bytes(self.v[layer]).view(shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, kv_heads, D] stored at slots [T] (quantized, with their scales, in a quantized pool)."""
        for pool, scales, x, groups in ((self.k[layer], self.k_scale[layer], k, self.key_groups),
                                        (self.v[layer], self.v_scale[layer], v, 1)):
            x = x.transpose(0, 1)  # [kv_heads, T, D]
            if self.quantized:
                x, x_scales = quantize(x, pool.dtype, groups)
                scales.index_copy_(1, slots, x_scales)
            else:
                x = x.to(pool.dtype)  # rounds to nearest even into a narrower float pool; a no-op for its own
            as_bytes(pool).index_copy_(1, slots, as_bytes(x))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [B, N] -> keys, values [B, kv_heads, N * block_size, D], one copy each.

        The copies live in buffers that the next gather overwrites: use them before gathering again.
        """
        batch, length = block_ids.shape[0], block_ids.shape[1] * self.block_size
        k_blocks, v_blocks = self.blocks(layer)
        kv_heads, _, _, head_dim = k_blocks.shape
        flat = block_ids.flatten()
        shape = (kv_heads, flat.numel(), self.block_size, head_dim)
        size = math.prod(shape)
        if self._gathered_k.numel() < size:  # grows to the largest group seen, then stays (as k_blocks' dtype)
            self._gathered_k, self._gathered_v = k_blocks.new_empty(size), v_blocks.new_empty(size)
        keys = torch.index_select(k_blocks, 1, flat, out=self._gathered_k[:size].view(shape))
        values = torch.index_select(v_blocks, 1, flat, out=self._gathered_v[:size].view(shape))
        if self.quantized:
            pool_dtype = self.k[layer].dtype
            keys = dequantize(keys.view(pool_dtype), self._gather_scales(self.k_scale[layer], flat),
                              self.compute_dtype)
            values = dequantize(values.view(pool_dtype), self._gather_scales(self.v_scale[layer], flat),
                                self.compute_dtype)
        elif self.converts:
            keys, values = self._converted(keys, values)
        return (keys.view(kv_heads, batch, length, head_dim).transpose(0, 1),
                values.view(kv_heads, batch, length, head_dim).transpose(0, 1))

    def _converted(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float pool's gathered keys / values widened (or narrowed) to compute_dtype, in buffers
        reused like the gathered ones: SDPA and the prefill kernel take queries and keys of one dtype."""
        size = keys.numel()
        if self._converted_k.numel() < size:
            self._converted_k, self._converted_v = keys.new_empty(size, dtype=self.compute_dtype), \
                values.new_empty(size, dtype=self.compute_dtype)
        return (self._converted_k[:size].view(keys.shape).copy_(keys),
                self._converted_v[:size].view(values.shape).copy_(values))

    def _gather_scales(self, scales: torch.Tensor, flat_blocks: torch.Tensor) -> torch.Tensor:
        """scales [kv_heads, num_slots, *G] -> [kv_heads, len(flat_blocks), block_size, *G]."""
        return self._scale_blocks(scales).index_select(1, flat_blocks)

    def _scale_blocks(self, scales: torch.Tensor) -> torch.Tensor:
        """scales [kv_heads, num_slots, *G] viewed as [kv_heads, num_blocks + 1, block_size, *G]."""
        return scales.view(scales.shape[0], -1, self.block_size, *scales.shape[2:])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates whole blocks (src -> dst) in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k[0].device)
        dst = torch.tensor([d for _, d in copies], device=self.k[0].device)
        for layer in range(len(self.k)):
            scales = (self.k_scale[layer], self.v_scale[layer]) if self.quantized else ()
            for pool in (*self.blocks(layer), *(self._scale_blocks(s) for s in scales)):
                pool[:, dst] = pool[:, src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)


# Queries per sequence up to which attention reads the pools in place (decodes, verify chunks, a
# prompt's last few tokens). The kernel attends each query as a decode of its own: over SmolLM2's
# heads it takes a third to a half of gather + SDPA's time at 9 queries (128-2,048 keys) and is
# even with it at 17 by 2,048 keys, where SDPA's blocked products start to win.
