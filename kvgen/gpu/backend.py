"""The Triton attention backend: PagedAttention whose KV store and attention run kvgen.gpu's kernels.

The runner builds the same metadata as on the CPU (slot mapping, groups with block tables and
masks); each group's mask becomes a [lo, hi) key range per query once per step (`key_ranges`), and
every layer reuses it. Groups the kernels do not cover go through PagedAttention's torch path
(gather + SDPA), so every cache policy keeps working: heavy-hitter scoring, re-rotated sink keys,
and masks that are not one run of keys per query (attention sinks beside a window).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgen.gpu.triton_attention import key_ranges, paged_attention, store_kv
from kvgen.model.attention import PagedAttention, PagedGroup, PagedKVCache, PagedMetadata


class TritonPagedAttention(PagedAttention):
    """PagedAttention over Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""

    def __init__(self, cache: PagedKVCache, meta: PagedMetadata, decode_kernel: object = None,
                 more_kinds: Sequence[tuple[PagedKVCache, PagedMetadata]] = (),
                 layer_kinds: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(cache, meta, None, more_kinds, layer_kinds)  # no CPU kernels on this path
        self._ranges: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def _write(self, cache: PagedKVCache, meta: PagedMetadata, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if cache.quantized:
            cache.write(layer, meta.slot_mapping, k, v)
            return
        store_kv(cache.k[layer], meta.slot_mapping, k)
        store_kv(cache.v[layer], meta.slot_mapping, v)

    def _attend(self, cache: PagedKVCache, layer: int, key: tuple[int, int], group: PagedGroup,
                rows: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """The Triton kernel where the group's keys are one run per query and there are no sink
        logits (it takes none), else PagedAttention's torch path."""
        ranges = self._group_ranges(key, group)
        if ranges is None or sinks is not None:
            return super()._attend(cache, layer, key, group, rows, sinks)
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
        return paged_attention(rows, cache.k[layer], cache.v[layer], group.kv_blocks, *ranges,
                               cache.block_size, group.mask.shape[2], *scales)

    def _group_ranges(self, key: tuple[int, int], group: PagedGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The group's (lo, hi) per query row, or None where the torch path must attend it."""
        if key not in self._ranges:
            ranges = None
            if group.score_rows is None and group.key_rotation is None:
                batch, _, num_queries, length = group.mask.shape
                lo, hi, one_run = key_ranges(group.mask.view(batch * num_queries, length))
                if bool(one_run):
                    ranges = (lo, hi)
            self._ranges[key] = ranges
        return self._ranges[key]

    def decodes_in_place(self) -> bool:
        return False  # the fused CPU decode program never runs on this path
