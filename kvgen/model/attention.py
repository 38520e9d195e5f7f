"""Attention backends: how a layer's new K/V are stored and which cached K/V a query reads.

The model computes q, k, v (RoPE applied) for the tokens of one step and hands them to a backend:

    NoCacheAttention     the whole sequence is recomputed every step; nothing is stored.
    ContiguousAttention  one sequence, a preallocated cache [batch, kv_heads, max_seq, head_dim]
                         per layer; K/V appended at the next positions (the textbook KV cache).
    PagedAttention       a ragged batch of many sequences over a block pool: K/V written at slot
                         indices, read back through per-sequence block tables (PagedAttention);
                         decodes and speculative verify chunks on the CPU read the blocks in
                         place (kvgen.model.kernels.paged_decode).

Each backend is an explicit object passed to `DecoderModel.forward`; nothing global is read. The
storage they read and write (ContiguousKVCache, PagedKVCache) is kvgen.model.kv_storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.model.kernels.paged_decode import GroupDecode, PagedDecode, stores
from kvgen.model.kernels.prefill import prefill_attention_kernel
from kvgen.model.kv_storage import ContiguousKVCache, PagedKVCache
from kvgen.model.layers import apply_rope


class Attention(ABC):
    """Stores this step's K/V (if it caches) and returns the attention output."""

    @abstractmethod
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D]; `sinks` [heads]: a logit per head
        that joins each softmax's denominator with no value (gpt-oss), or None."""

    def attend_shared(self, donor: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, D] over the K/V layer `donor` stored this step and before, storing nothing
        (a Gemma 4 layer sharing its donor's K/V, with the donor's window) -> [T, heads, D]."""
        raise NotImplementedError(f"{type(self).__name__} cannot attend over another layer's K/V")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, heads, D], k/v [B, L, kv_heads, D], mask [B, 1, Q, L] or None -> [B, Q, heads, D]."""
    return sdpa_heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal,
                            sinks).transpose(1, 2)


def sdpa_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, heads, Q, D], k/v [B, kv_heads, L, D], mask [B, 1, Q, L] or None, sinks [heads] or None
    -> [B, heads, Q, D]."""
    if sinks is not None:
        return _sdpa_with_sinks(q, k, v, mask, causal, sinks)
    batch, heads, num_queries, head_dim = q.shape
    kv_heads = k.shape[1]
    if num_queries == 1 and heads != kv_heads and not causal:
        # One query (decode): the heads sharing a KV head become that head's query rows, so K/V are
        # read once per KV head. Same result; in bf16 about 5x faster than `enable_gqa`. CUDA's
        # memory-efficient kernel may return the rows strided, hence reshape rather than view.
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(batch, heads, 1, head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=heads != kv_heads)


def _sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                     sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head, through SDPA: one more key and value, both zero, whose
    score q . 0 = 0 plus an additive mask of sinks[h] is the sink; its value adds nothing. Same shapes
    as sdpa_heads_first."""
    batch, heads, num_queries, head_dim = q.shape
    length = k.shape[2]
    if mask is None:  # causal as SDPA's is_causal (query i reads keys 0..i: a chunk from position 0), or every key
        mask = torch.ones(num_queries, length, dtype=torch.bool, device=q.device)
        mask = (mask.tril() if causal else mask)[None, None]
    bias = torch.zeros(mask.shape[0], heads, num_queries, length + 1, dtype=q.dtype, device=q.device)
    bias[..., :length].masked_fill_(~mask, float("-inf"))  # [B, heads, Q, L + 1]
    bias[..., length] = sinks.to(q.dtype)[:, None]
    zero = k.new_zeros(batch, k.shape[1], 1, head_dim)
    k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)  # [B, kv_heads, L + 1, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=heads != k.shape[1])


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q] and [L] positions -> [Q, L] bool: causal, and within the last `window` tokens if given."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - window
    return allowed


LayerWindows = Sequence[int | None]  # each layer's sliding window (None: global); empty: none anywhere


def _window(windows: LayerWindows, layer: int) -> int | None:
    return windows[layer] if windows else None


class NoCacheAttention(Attention):
    """Plain causal attention over the tokens given: the baseline without a KV cache."""

    def __init__(self, windows: LayerWindows = ()) -> None:
        self.windows = windows
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this pass's K/V, for layers sharing them

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._kv[layer] = (k, v)
        return self._attend(layer, q, k, v, sinks)

    def attend_shared(self, donor: int, q: torch.Tensor) -> torch.Tensor:
        return self._attend(donor, q, *self._kv[donor])

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        window = _window(self.windows, layer)
        if window is None or q.shape[0] <= window:
            return sdpa(q[None], k[None], v[None], None, causal=True, sinks=sinks)[0]
        positions = torch.arange(q.shape[0], device=q.device)
        mask = window_mask(positions, positions, window)
        return sdpa(q[None], k[None], v[None], mask[None, None], causal=False, sinks=sinks)[0]


class ContiguousAttention(Attention):
    """Appends the new tokens' K/V at positions [start, start + T) and attends over [0, start + T)."""

    def __init__(self, cache: ContiguousKVCache, start: int, windows: LayerWindows = ()) -> None:
        self.cache = cache
        self.start = start
        self.windows = windows

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.cache.k[layer][0, :, self.start : end] = k.transpose(0, 1)
        self.cache.v[layer][0, :, self.start : end] = v.transpose(0, 1)
        return self._attend(layer, q, sinks)

    def attend_shared(self, donor: int, q: torch.Tensor) -> torch.Tensor:
        return self._attend(donor, q)

    def _attend(self, layer: int, q: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        end = self.start + q.shape[0]
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        keys = k_cache[:, :, :end].transpose(1, 2)  # [1, L, kv_heads, D]
        values = v_cache[:, :, :end].transpose(1, 2)
        window = _window(self.windows, layer)
        if self.start == 0 and (window is None or end <= window):
            return sdpa(q[None], keys, values, None, causal=True, sinks=sinks)[0]
        if q.shape[0] == 1 and (window is None or end <= window):
            return sdpa(q[None], keys, values, None, causal=False, sinks=sinks)[0]
        device = q.device
        mask = window_mask(torch.arange(self.start, end, device=device), torch.arange(end, device=device), window)
        return sdpa(q[None], keys, values, mask[None, None], causal=False, sinks=sinks)[0]


@dataclass
class PagedGroup:
    """B sequences of Q queries each, attended together in one SDPA call (decodes of similar length,
    or one prefill chunk), their keys padded to the longest.

    first_row              the group's B * Q queries are rows [first_row, first_row + B * Q) of the step
    kv_blocks   [B, N]:    pool blocks the sequence reads, in order (padding -> the scratch block);
                           its L = N * block_size keys are read in that order
    mask        [B, 1, Q, L]: True where query i of sequence b may attend to key j
    causal_from            or None: `mask` is plain causal over the sequence's keys from position 0 and
                           its queries sit at positions causal_from, causal_from + 1, ... (a prompt
                           chunk of one sequence that keeps every token): the prefill kernel, or
                           from 0 SDPA's own causal mask, replaces the mask
    key_rotation (cos, sin) [B, 1, L, D] or None: re-rotates cached keys whose RoPE position has
                 moved since they were written (attention sinks rank keys by their place in the cache)
    score_rows  [b] or None: rows whose attention weights are accumulated into `scores` [b, L]
                 (heavy-hitter tracking)
    """

    first_row: int
    kv_blocks: torch.Tensor
    mask: torch.Tensor
    causal_from: int | None = None
    key_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    score_rows: torch.Tensor | None = None
    scores: torch.Tensor | None = None


@dataclass
class PagedMetadata:
    """Everything a layer needs to read and write the block pool for one step; built once per step.

    slot_mapping [T]: pool slot where each token's K/V are written
    groups:           in row order, so their outputs concatenate into the step's rows
    """

    slot_mapping: torch.Tensor
    groups: list[PagedGroup]


IN_PLACE_QUERIES = 16


class PagedAttention(Attention):
    """Writes K/V at the step's slots, then attends each group of sequences through its block tables:
    decodes and verify chunks through `decode_kernel` (reads blocks in place) when given, else
    gather + SDPA."""

    def __init__(self, cache: PagedKVCache, meta: PagedMetadata, decode_kernel: PagedDecode | None = None,
                 more_kinds: Sequence[tuple[PagedKVCache, PagedMetadata]] = (),
                 layer_kinds: Sequence[tuple[int, int]] = ()) -> None:
        """`cache` and `meta`: the pools of every layer, or of a hybrid model's global layers, with
        `more_kinds` the pools and metadata of its windowed layers and `layer_kinds` each model
        layer's (kind, index in that kind's pools) (kvgen.cache.hybrid)."""
        self.cache = cache
        self.meta = meta
        self.kinds = [(cache, meta), *more_kinds]
        self.layer_kinds = layer_kinds
        self.decode_kernel = decode_kernel
        # The CPU kernels come together: where decodes read the pools in place, causal prompt chunks
        # take the prefill kernel (kvgen.model.kernels.prefill).
        self.prefill_kernel = prefill_attention_kernel() if decode_kernel is not None else None
        self._group_calls: dict[tuple[int, int], GroupDecode] = {}  # by (kind, group): the kernel's arguments

    def kind_of(self, layer: int) -> tuple[int, int]:
        """(kind, index of the layer in that kind's pools)."""
        return self.layer_kinds[layer] if self.layer_kinds else (0, layer)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        kind, local = self.kind_of(layer)
        cache, meta = self.kinds[kind]
        self._write(cache, meta, local, k, v)
        return self._attend_groups(layer, q, sinks)

    def attend_shared(self, donor: int, q: torch.Tensor) -> torch.Tensor:
        return self._attend_groups(donor, q)

    def _attend_groups(self, layer: int, q: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, D] over layer `layer`'s cached K/V, group by group -> [T, heads, D]."""
        kind, local = self.kind_of(layer)
        cache, meta = self.kinds[kind]
        outputs = []
        for index, group in enumerate(meta.groups):
            batch, _, num_queries, _ = group.mask.shape
            rows = q[group.first_row : group.first_row + batch * num_queries]
            outputs.append(self._attend(cache, local, (kind, index), group, rows, sinks))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _write(self, cache: PagedKVCache, meta: PagedMetadata, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K/V into the pools: through the kernel's store into float pools (the same bits
        as torch's .to() and index_copy_, in a third of the time), else PagedKVCache.write."""
        if self.decode_kernel is not None and stores(k.dtype, cache.k[layer].dtype):
            self.decode_kernel.store(cache.k[layer], cache.v[layer], meta.slot_mapping, k, v)
        else:
            cache.write(layer, meta.slot_mapping, k, v)

    def _attend(self, cache: PagedKVCache, layer: int, key: tuple[int, int], group: PagedGroup,
                rows: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """rows [B * Q, heads, D] -> [B * Q, heads, D]: through the decode kernel where it applies, else
        through a gathered copy of the group's K/V (also gathered to record heavy-hitter weights): the
        prefill kernel for a causal prompt chunk, SDPA for the rest; each with the layer's sink logits
        where it has them (gpt-oss)."""
        in_place = self._in_place(group)
        if in_place and group.score_rows is None:  # a decode step's usual path: nothing else to build
            return self._decode(cache, layer, key, group, rows, sinks)
        batch, _, num_queries, _ = group.mask.shape
        queries = rows.view(batch, num_queries, *rows.shape[1:]).transpose(1, 2)  # [B, heads, Q, D]
        gathered = self._gather(cache, layer, group)
        if group.score_rows is not None:
            scored = group.score_rows
            group.scores += attention_weights(queries[scored], gathered[0][scored], group.mask[scored])
        if in_place:
            return self._decode(cache, layer, key, group, rows, sinks)
        keys, values = gathered
        if self.prefill_kernel is not None and group.causal_from is not None and batch == 1:
            out = self.prefill_kernel(rows, keys[0], values[0], group.causal_from, sinks)
            if out is not None:
                return out
        causal = group.causal_from == 0
        out = sdpa_heads_first(queries, keys, values, None if causal else group.mask, causal, sinks)
        return out.transpose(1, 2).reshape(rows.shape)

    def _decode(self, cache: PagedKVCache, layer: int, key: tuple[int, int], group: PagedGroup,
                rows: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """rows [B * Q, heads, D] through the kernel, reading the layer's pools in place. The kernel's
        call for the group is built at its first layer and reused by the others."""
        call = self._group_calls.get(key)
        if call is None:
            batch, _, num_queries, length = group.mask.shape
            call = self.decode_kernel.for_group(group.kv_blocks, cache.block_size,
                                                group.mask.view(batch * num_queries, length))
            self._group_calls[key] = call
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else None
        return call(rows, cache.k[layer], cache.v[layer], scales, sinks)

    def decodes_in_place(self) -> bool:
        """Every group attends through the kernel, with no weights to record: the step's attention is
        the kernel's alone (kvgen.model.fused runs such steps from C)."""
        return all(self._in_place(group) and group.score_rows is None
                   for _, meta in self.kinds for group in meta.groups)

    def _in_place(self, group: PagedGroup) -> bool:
        """The kernel reads the cached keys as they are, for a decode or a verify chunk's few queries
        per sequence (each query as a decode of its own: the same bits as decoding its token)."""
        return (self.decode_kernel is not None and group.mask.shape[2] <= IN_PLACE_QUERIES
                and group.key_rotation is None)

    def _gather(self, cache: PagedKVCache, layer: int, group: PagedGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys (re-rotated where asked) and values [B, kv_heads, L, D]."""
        keys, values = cache.gather(layer, group.kv_blocks)
        if group.key_rotation is not None:
            keys = apply_rope(keys, *group.key_rotation)
        return keys, values


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [b, heads, Q, D], k [b, kv_heads, L, D], mask [b, 1, Q, L] -> [b, L]: softmax weights each key
    received, summed over heads and queries (what heavy-hitter eviction ranks keys by)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("bhqd,bhld->bhql", q.float(), k.float()) / q.shape[-1] ** 0.5
    weights = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)  # [b, heads, Q, L]
    return weights.sum(dim=(1, 2))
