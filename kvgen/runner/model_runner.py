"""Turns a schedule into tensors, runs the model once over the ragged batch, returns logits.

The flat batch puts decode tokens first, then prefill chunks:

    rows       [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]          T rows, one forward pass
    groups       decodes: 3 x 1 query       prefill 0: 4 queries   prefill 1: 2; one attention call each
    slots      where each token's K/V go: block_table[pos // block_size] * block_size + pos % block_size

Each group's queries are consecutive rows, so its outputs come back in row order. Decodes are
sorted by how many blocks they read and cut into groups of similar length, so that padding each
sequence's keys to the longest of its group costs little where they are gathered for SDPA (the
CPU decode kernel skips padding unread); a prompt chunk of a sequence that keeps every token is
plainly causal (`causal_from`): the CPU prefill kernel, or SDPA's causal mask from position 0,
skips the blocks above the diagonal.

Each sequence reads only the blocks its cache policy still holds (null entries are skipped), so a
bounded cache costs the same per token however long the text grows. Per-step metadata is built
once here and shared by every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.hybrid import LayerKind
from kvgen.cache.state_pool import StatePool
from kvgen.config import EngineConfig
from kvgen.model.attention import PagedAttention, PagedGroup, PagedMetadata
from kvgen.model.decoder import DecoderModel
from kvgen.model.kernels.paged_decode import PagedDecode, paged_decode_for
from kvgen.model.kv_quant import STORAGE_DTYPES
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.linear import blas_owns_the_cores
from kvgen.runner.policy_tensors import FAR, PolicyTensors, ScoreTarget
from kvgen.runner.state_batch import StepStates, step_states
from kvgen.scheduling.output import ScheduledChunk

T = TypeVar("T")
Head = Callable[[torch.Tensor], torch.Tensor]  # hidden states [rows, hidden] -> fp32 logits [rows, columns]


class BlockTables(Protocol):
    def live_blocks(self, seq_id: int) -> list[tuple[int, int]]: ...

    def block_id(self, seq_id: int, index: int) -> int: ...


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] RoPE positions
    meta: PagedMetadata
    logit_rows: torch.Tensor  # [S] rows whose hidden states give logits, in the chunks' order
    score_targets: list[ScoreTarget]
    more_metas: list[PagedMetadata] = field(default_factory=list)  # the other kinds' (ModelRunner.kinds[1:])
    states: StepStates | None = None  # the recurrent layers' slots (a model with a state pool)
    hidden: torch.Tensor | None = None  # [T, hidden] each row's input hidden state, for a model that reads one
    # (seq_id, first position, first row, rows) of each chunk whose output hidden states the step keeps
    kept: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class KVKind:
    """The pools and block tables of one kind of layer: every layer of most models; in a hybrid model
    (kvgen.cache.hybrid) the global layers, or those of one sliding window."""

    cache: PagedKVCache  # pools of `layers` only, in that order
    tables: BlockTables
    window: int | None
    layers: list[int]


class ModelRunner:
    """Owns the model and the KV pools; lays out a step's batch and runs it; knows tensors, not queues.
    `more_kinds`: a hybrid model's windowed layers, beside the global ones in `cache`. `heavy_hitters`:
    the cache layer's h2o scores, which the runner masks by and adds each step's attention to (its
    own when not given: a runner that never sees h2o, the draft model's)."""

    attention_type = PagedAttention  # on CUDA kvgen.gpu.graphs.gpu_runner sets the Triton backend

    def __init__(self, model: DecoderModel, cache: PagedKVCache, block_tables: BlockTables,
                 decode_kernel: PagedDecode | None = None, more_kinds: list[KVKind] = (),
                 heavy_hitters: HeavyHitters | None = None) -> None:
        self.model = model
        self.cache = cache
        self.decode_kernel = decode_kernel
        self.block_tables = block_tables
        self.device = model.device
        if heavy_hitters is None:
            heavy_hitters = HeavyHitters(self.device, cache.block_size)
        self.policy_tensors = PolicyTensors(self.device, model.rope.tables, model.max_positions, heavy_hitters)
        config = model.config
        first_layers = [i for i in config.kv_holders if all(i not in kind.layers for kind in more_kinds)]
        self.kinds = [KVKind(cache, block_tables, None, first_layers), *more_kinds]
        # per model layer: (its kind, its index in that kind's pools); a layer reading another's K/V, its
        # donor's; None for a recurrent layer, which keeps a state slot instead (kvgen.cache.state_pool)
        self.layer_kinds = [None if i in config.recurrent_layers else
                            next((k, kind.layers.index(d)) for k, kind in enumerate(self.kinds) if d in kind.layers)
                            for i, d in enumerate(map(config.kv_donor, range(config.num_layers)))]
        self._maps_layers = len(self.kinds) > 1 or len(config.kv_holders) < config.num_layers
        self.state_pool: StatePool | None = None  # a recurrent model's, set by the engine (kvgen.engine.recurrent)
        # Whether steps keep their chunks' output hidden states, and those of the last step: seq_id ->
        # (first position, [rows, hidden]); an MTP head reads the target's (kvgen.engine.speculative.mtp).
        self.keeps_hidden = False
        self.kept_hidden: dict[int, tuple[int, torch.Tensor]] = {}

    def copy_blocks(self, copies: list[tuple[int, int]] | list[list[tuple[int, int]]]) -> None:
        """Copy-on-write copies before the step: a list per kind where there are several kinds."""
        per_kind = copies if len(self.kinds) > 1 else [copies]
        for kind, kind_copies in zip(self.kinds, per_kind):
            kind.cache.copy_blocks(kind_copies)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int] = frozenset(),
                head: Head | None = None) -> torch.Tensor:
        """Runs one step; returns fp32 logits in the order of `chunks`: every row of a chunk whose
        seq_id is in `all_logits`, else one row per chunk that completes its sequence. `head` turns
        those rows' hidden states into logits (default: the model's LM head)."""
        return self.run(self.prepare(chunks, all_logits), head)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, head: Head | None = None) -> torch.Tensor:
        """The forward pass over a prepared step (tensor-parallel workers get theirs from rank 0)."""
        attention = self.attention_type(self.cache, inputs.meta, self.decode_kernel,
                                   [(kind.cache, meta) for kind, meta in zip(self.kinds[1:], inputs.more_metas)],
                                   self.layer_kinds if self._maps_layers else ())
        reads = {} if inputs.hidden is None else {"hidden": inputs.hidden}
        with blas_owns_the_cores(self.model.device, self.model.dtype, gemv_only=len(inputs.token_ids) == 1):
            hidden = self.model.forward(inputs.token_ids, inputs.positions, attention, states=inputs.states, **reads)
            self.policy_tensors.collect_scores(inputs.score_targets)
            self.kept_hidden = {seq_id: (start, hidden[row : row + rows].clone())
                                for seq_id, start, row, rows in inputs.kept}
            return (head or self.model.logits)(hidden[inputs.logit_rows])

    def prepare(self, chunks: list[ScheduledChunk], all_logits: set[int] = frozenset()) -> StepInputs:
        """Lays out the step's rows and builds every tensor of it.

        Chunks are laid out decodes first (in groups of similar length), then each prefill chunk.
        """
        reads = {c.seq.seq_id: self._blocks_read(c, self.kinds[0]) for c in chunks}
        decodes = [c for c in chunks if c.num_tokens == 1]
        chunk_groups = [*similar_lengths(decodes, lambda c: len(reads[c.seq.seq_id])),
                        *self._verify_groups([c for c in chunks if c.num_tokens > 1 and c.draft], reads),
                        *([c] for c in chunks if c.num_tokens > 1 and not c.draft)]
        ordered = [c for group in chunk_groups for c in group]
        meta, positions, score_targets = self._metadata(self.kinds[0], chunk_groups, ordered, reads)
        more_metas = [self._metadata(kind, chunk_groups, ordered)[0] for kind in self.kinds[1:]]
        token_ids = [t for c in ordered for t in c.token_ids]
        first_rows = list(itertools.accumulate((c.num_tokens for c in ordered), initial=0))
        return StepInputs(
            token_ids=torch.tensor(token_ids, device=self.device),
            positions=positions,
            meta=meta,
            logit_rows=torch.tensor(_logit_rows(chunks, ordered, all_logits), dtype=torch.long, device=self.device),
            score_targets=score_targets,
            more_metas=more_metas,
            states=(None if self.state_pool is None else
                    step_states(self.state_pool, self.model.config.recurrent_layers, ordered)),
            hidden=torch.cat([c.hidden for c in ordered]) if self.model.reads_hidden else None,
            kept=([(c.seq.seq_id, c.start, row, c.num_tokens) for c, row in zip(ordered, first_rows)]
                  if self.keeps_hidden else []),
        )

    def _metadata(self, kind: KVKind, chunk_groups: list[list[ScheduledChunk]], ordered: list[ScheduledChunk],
                  reads: dict[int, list[tuple[int, int]]] | None = None
                  ) -> tuple[PagedMetadata, torch.Tensor, list[ScoreTarget]]:
        """One kind's metadata for the step's rows (laid out once, the same for every kind): the
        slots its tables give, the groups over the blocks it still holds; and the rows' RoPE
        positions and heavy-hitter targets."""
        reads = reads or {c.seq.seq_id: self._blocks_read(c, kind) for c in ordered}
        groups: list[PagedGroup] = []
        score_targets: list[ScoreTarget] = []
        positions = []
        first_row = 0
        for group_chunks in chunk_groups:
            group, group_pos, target = self._group(group_chunks, reads, first_row, kind.window)
            groups.append(group)
            if target is not None:
                score_targets.append(target)
            positions.append(group_pos)
            first_row += group_pos.numel()
        slots = [s for c in ordered for s in self._write_slots(c, kind.tables)]
        meta = PagedMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device), groups=groups)
        return meta, torch.cat(positions), score_targets

    @staticmethod
    def _verify_groups(chunks: list[ScheduledChunk], reads: dict[int, list[tuple[int, int]]]
                       ) -> list[list[ScheduledChunk]]:
        """Speculative chunks (a decode plus its draft) of the same length attend together, like decodes."""
        by_length: dict[int, list[ScheduledChunk]] = {}
        for c in chunks:
            by_length.setdefault(c.num_tokens, []).append(c)
        return [group for same in by_length.values()
                for group in similar_lengths(same, lambda c: len(reads[c.seq.seq_id]))]

    def _group(self, chunks: list[ScheduledChunk], reads: dict[int, list[tuple[int, int]]],
               first_row: int, window: int | None = None) -> tuple[PagedGroup, torch.Tensor, ScoreTarget | None]:
        """One SDPA group, B chunks of Q tokens each (B decodes, or one prefill chunk): its keys read
        through the live blocks [B, L], within the layers' `window` if they have one; returns it, the
        RoPE positions of its rows and its h2o target."""
        device = self.device
        num_queries = chunks[0].num_tokens
        start = torch.tensor([c.start for c in chunks], device=device)  # [B]
        q_pos = start[:, None] + torch.arange(num_queries, device=device)[None, :]  # [B, Q] token indices
        kv_blocks, k_pos = self._live_keys([reads[c.seq.seq_id] for c in chunks])  # [B, N], [B, L]
        policies, tensors = [c.seq.policy for c in chunks], self.policy_tensors
        mask = tensors.mask(policies, q_pos, k_pos, window)  # [B, Q, L]
        unbounded = window is None or chunks[0].start + num_queries <= window
        one_whole_sequence = len(chunks) == 1 and num_queries > 1 and policies[0].kind == "full" and unbounded
        group = PagedGroup(first_row, kv_blocks, mask[:, None], chunks[0].start if one_whole_sequence else None)
        tensors.add_sink_rotation(group, policies, q_pos[:, -1], k_pos)
        target = tensors.add_heavy_hitters(group, [c.seq.seq_id for c in chunks], policies,
                                           [c.start + c.num_tokens for c in chunks], k_pos)
        return group, tensors.rope_positions(policies, q_pos).flatten(), target

    def _blocks_read(self, c: ScheduledChunk, kind: KVKind) -> list[tuple[int, int]]:
        """(block index, block id) of every block the chunk's queries read in one kind's tables: those
        its sequence still holds, up to the one of its last token."""
        needed = -(-(c.start + c.num_tokens) // self.cache.block_size)
        return [(i, b) for i, b in kind.tables.live_blocks(c.seq.seq_id) if i < needed]

    def _live_keys(self, reads: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids [B, N] each sequence reads, and the token index of each key [B, N * block_size].
        Rows are padded with the scratch block at position FAR."""
        block_size, scratch = self.cache.block_size, self.cache.num_blocks
        width = max(len(r) for r in reads)
        far_block = FAR // block_size
        ids_t = torch.tensor([[b for _, b in r] + [scratch] * (width - len(r)) for r in reads], device=self.device)
        idx_t = torch.tensor([[i for i, _ in r] + [far_block] * (width - len(r)) for r in reads], device=self.device)
        offsets = torch.arange(block_size, device=self.device)
        return ids_t, (idx_t[:, :, None] * block_size + offsets).flatten(1)

    def _write_slots(self, c: ScheduledChunk, tables: BlockTables) -> list[int]:
        block_size, block_id = self.cache.block_size, tables.block_id
        return [block_id(c.seq.seq_id, p // block_size) * block_size + p % block_size
                for p in range(c.start, c.start + c.num_tokens)]


def similar_lengths(items: list[T], length: Callable[[T], int], min_fill: float = 0.75) -> list[list[T]]:
    """Items sorted longest first and cut where one is shorter than `min_fill` of its group's longest:
    padding each group to its longest then wastes at most 1 - min_fill of it. (Each group costs an
    attention call per layer, so groups are not cut finer.)"""
    groups: list[list[T]] = []
    longest = 0
    for item in sorted(items, key=length, reverse=True):
        if not groups or length(item) < min_fill * longest:
            groups.append([])
            longest = length(item)
        groups[-1].append(item)
    return groups


def _logit_rows(chunks: list[ScheduledChunk], ordered: list[ScheduledChunk], all_logits: set[int]) -> list[int]:
    """Flat rows whose logits are wanted, in the order of `chunks`."""
    first = {}
    row = 0
    for c in ordered:
        first[id(c)] = row
        row += c.num_tokens
    rows = []
    for c in chunks:
        end = first[id(c)] + c.num_tokens
        if c.seq.seq_id in all_logits:
            rows.extend(range(first[id(c)], end))
        elif c.completes_sequence:
            rows.append(end - 1)
    return rows


def build_hybrid_runner(model: DecoderModel, config: EngineConfig, kinds: list[LayerKind], kind_blocks: list[int],
                        tables: list[BlockTables], heavy_hitters: HeavyHitters | None = None) -> ModelRunner:
    """The runner over one pool per kind of layer (kvgen.cache.hybrid), the global kind first."""
    cfg = model.config
    pool_dtype = STORAGE_DTYPES[config.kv_dtype]
    caches = [PagedKVCache(len(kind.layers), n, config.block_size, cfg.kv_heads_of(kind.layers[0]),
                           cfg.head_dim_of(kind.layers[0]), model.device, pool_dtype, compute_dtype=model.dtype)
              for kind, n in zip(kinds, kind_blocks)]
    decode_kernel = paged_decode_for(config.attention_backend, model.device, model.dtype, pool_dtype)
    more = [KVKind(cache, table, kind.window, list(kind.layers))
            for cache, table, kind in zip(caches[1:], tables[1:], kinds[1:])]
    return _on_device(ModelRunner(model, caches[0], tables[0], decode_kernel, more, heavy_hitters), config)


def build_runner(model: DecoderModel, config: EngineConfig, num_blocks: int, block_tables: BlockTables | None,
                 cache_type: Callable[..., PagedKVCache] = PagedKVCache,
                 runner_type: Callable[..., ModelRunner] = ModelRunner,
                 heavy_hitters: HeavyHitters | None = None) -> ModelRunner:
    """The runner over KV pools of `num_blocks` blocks for the model's (local) KV heads."""
    cfg = model.config
    pool_dtype = STORAGE_DTYPES[config.kv_dtype]
    cache = cache_type(len(cfg.kv_holders), num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                       model.device, pool_dtype, compute_dtype=model.dtype)
    decode_kernel = paged_decode_for(config.attention_backend, model.device, model.dtype, pool_dtype)
    return _on_device(runner_type(model, cache, block_tables, decode_kernel, heavy_hitters=heavy_hitters), config)


def _on_device(runner: ModelRunner, config: EngineConfig) -> ModelRunner:
    """A runner on CUDA takes the Triton backend and decode graphs (imported only there)."""
    if runner.device.type != "cuda" or config.attention_backend == "sdpa":
        return runner
    from kvgen.gpu.graphs import gpu_runner
    return gpu_runner(runner, config)
