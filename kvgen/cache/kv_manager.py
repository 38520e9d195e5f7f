"""Per-sequence block tables over a shared `BlockPool`: allocation, prefix reuse, copy-on-write.

Token t of a sequence lives at slot `table[t // block_size] * block_size + t % block_size`.
With block_size 4, two sequences sharing a cached 8-token prefix, and a fork of B:

    seq A (10 tokens): [ 3 | 5 | 8 ]        blocks 3, 5: full, cached (hash chain h3 -> h5)
    seq B ( 9 tokens): [ 3 | 5 | 1 ]        prefix hit on 3, 5 (ref_count 2 each)
    fork C of B:       [ 3 | 5 | 1 ]        block 1 is partial and shared (ref_count 2)
    C appends:         [ 3 | 5 | 6 ]        copy-on-write: pending copy (1 -> 6)

A bounded cache (sliding window, attention sinks, heavy hitters) drops blocks it no longer reads:

    free_blocks_before(A, 8):  [ -1 | -1 | 8 ]   (NULL_BLOCK entries are never written)
    release_blocks(A, [1]):    [ 3 | -1 | 8 ]    (any entry but the newest may be dropped)

The manager tracks, per sequence, how many token slots its table covers (`num_slots`); each
`allocate` extends that by `num_new_tokens`, which the runner then computes in the next step.

`block_states()` is a read-only picture of the pool for the dashboard: one state per block,

    free      ref_count 0, nothing reusable in it
    cached    ref_count 0, holding a hashed prefix a later prompt can revive
    used      ref_count 1
    shared    ref_count > 1 (a prefix hit, or the prompt blocks of an n > 1 request)
    released  ref_count 0, given back by a cache policy (window, sinks, h2o) lately (the caller says which)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvgen.cache.block_pool import Block, BlockPool, hash_block

NULL_BLOCK = -1
BLOCK_STATES = ("free", "cached", "used", "shared", "released")
FREE, CACHED, USED, SHARED, RELEASED = range(len(BLOCK_STATES))
NO_OWNER = -1


@dataclass(frozen=True)
class BlockStates:
    """The pool at one moment. `owner` is the sequence holding the block (of a shared block, the one
    that has been in the manager longest), NO_OWNER for a free block."""

    codes: np.ndarray  # [num_blocks] int8, an index into BLOCK_STATES
    owner: np.ndarray  # [num_blocks] int64 seq_id or NO_OWNER
    ref_count: np.ndarray  # [num_blocks] int32

    def counts(self) -> dict[str, int]:
        """Blocks in each state, every state named (they add up to the pool size)."""
        return dict(zip(BLOCK_STATES, np.bincount(self.codes, minlength=len(BLOCK_STATES)).tolist()))


@dataclass
class _SeqState:
    """Bookkeeping of one live sequence."""

    # index in the table -> block id; released entries are absent (NULL_BLOCK), so reading the live
    # blocks costs O(live) however long a bounded-cache sequence has run. Keys stay in index order.
    blocks: dict[int, int] = field(default_factory=dict)
    num_entries: int = 0
    num_slots: int = 0  # token slots the table covers
    num_hashed: int = 0  # leading full blocks already offered to the prefix cache
    last_hash: int | None = None  # chain hash of block num_hashed - 1

    def copy(self) -> _SeqState:
        return _SeqState(dict(self.blocks), self.num_entries, self.num_slots, self.num_hashed, self.last_hash)

    @property
    def live_blocks(self) -> list[int]:
        return list(self.blocks.values())

    @property
    def table(self) -> list[int]:
        return [self.blocks.get(i, NULL_BLOCK) for i in range(self.num_entries)]

    @property
    def last_block(self) -> int:
        return self.blocks[self.num_entries - 1]

    def append(self, block_id: int) -> None:
        self.blocks[self.num_entries] = block_id
        self.num_entries += 1


class KVCacheManager:
    """Block tables of live sequences (keyed by an opaque int `seq_id`) over one block pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not 1 <= block_size <= 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._seqs: dict[int, _SeqState] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from cached blocks
        self.prefix_hit_blocks = 0

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, cached-evictable ones included."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return self.pool.num_used / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0 before any)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def live_blocks(self, seq_id: int) -> list[tuple[int, int]]:
        """(index in the table, block id) of every block the sequence still holds, in order."""
        return list(self._state(seq_id).blocks.items())

    def block_id(self, seq_id: int, index: int) -> int:
        """The block at `index` of the sequence's table (NULL_BLOCK if released)."""
        return self._state(seq_id).blocks.get(index, NULL_BLOCK)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in token order (NULL_BLOCK where a window dropped a block)."""
        return list(self._state(seq_id).table)

    def num_slots(self, seq_id: int) -> int:
        """Token slots the sequence's table covers (computed tokens + those scheduled)."""
        return self._state(seq_id).num_slots

    def num_live_blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds now (released entries not counted)."""
        return len(self._state(seq_id).blocks)

    def block_states(self, released: Iterable[int] = ()) -> BlockStates:
        """Every block's state, owner and reference count; changes nothing. O(num_blocks) in numpy plus
        C-level passes over the tables and the hash map (a few ms for 100,000 blocks).

        `released` names blocks a cache policy gave back lately (the engine's step log knows which);
        those still free are shown as "released" rather than free or cached.
        """
        held = [np.fromiter(state.blocks.values(), np.int64, count=len(state.blocks)) for state in self._seqs.values()]
        # A block's ref_count is the number of tables holding it (check_invariants asserts it), which numpy
        # counts far faster than reading 100,000 Block objects.
        refs = np.bincount(np.concatenate(held) if held else np.zeros(0, np.int64),
                           minlength=self.num_blocks).astype(np.int32)
        codes = np.full(self.num_blocks, FREE, np.int8)
        codes[refs == 1] = USED
        codes[refs > 1] = SHARED
        hashed = self.pool.hashed_block_ids()
        codes[hashed[refs[hashed] == 0]] = CACHED
        gone = np.fromiter(released, np.int64)
        codes[gone[refs[gone] == 0]] = RELEASED
        owner = np.full(self.num_blocks, NO_OWNER, np.int64)
        for seq_id, ids in reversed(list(zip(self._seqs, held))):  # the oldest holder is written last, and wins
            owner[ids] = seq_id
        return BlockStates(codes, owner, refs)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence holding `num_tokens` tokens at once fits the pool at all."""
        return self.num_blocks_needed(num_tokens) <= self.num_blocks

    def slide(self, seq_id: int, num_computed_tokens: int) -> None:
        """Nothing: every layer keeps every token (kvgen.cache.hybrid's manager slides its windows)."""

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether the pool can hand out `num_blocks` blocks now (what `allocate` and `can_extend` ask)."""
        return num_blocks <= self.pool.num_free

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[Block]:
        """Longest chain of cached full blocks matching the prompt's prefix; changes nothing.

        Never covers the last prompt token (it is recomputed for its logits), so
        `len(result) * block_size <= len(token_ids) - 1`.
        """
        blocks = self.cached_blocks(token_ids, extra_key)
        return blocks[:blocks.index(None)] if None in blocks else blocks

    def cached_blocks(self, token_ids: Sequence[int], extra_key: Hashable = None, count: int | None = None,
                      start: int = 0) -> list[Block | None]:
        """Per full block of the prompt (the first `count`; never the last prompt token's), the pool's
        cached block, or None: a windowed kind's hit needs only its last blocks (kvgen.cache.hybrid).
        A tiered manager first restores the blocks from `start` on that its tiers hold."""
        if not self.enable_prefix_caching:
            return []
        limit = (len(token_ids) - 1) // self.block_size
        blocks: list[Block | None] = []
        parent: int | None = None
        for i in range(limit if count is None else min(count, limit)):
            chunk = token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, chunk, extra_key)
            blocks.append(self.pool.lookup(parent, chunk))
        return blocks

    # -- mutations --------------------------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                 cached_prefix: list[Block | None] | None = None, num_lookahead: int = 0) -> bool:
        """Extends the sequence's table to cover `num_slots + num_new_tokens` slots.

        `num_lookahead` of the new slots may lie past the sequence's tokens: they hold speculative
        tokens being verified, and `truncate` takes back those that are rejected.

        The first call for a sequence creates it and may pass `cached_prefix` (from
        `find_cached_prefix`): those blocks join the table as already computed, and
        `num_new_tokens` counts from the end of the prefix. If the write would land in a
        partially filled block shared with another sequence, the block is first replaced by a
        fresh one and a pending copy is recorded (see `take_pending_copies`).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        state = self._seqs.get(seq_id)
        is_new = state is None
        prefix = cached_prefix or []
        if not is_new and prefix:
            raise ValueError(f"sequence {seq_id}: cached_prefix is only allowed on its first allocate")
        state = state or _SeqState()
        self._check_allocate_args(state, len(token_ids) + num_lookahead, token_ids, num_new_tokens, prefix)
        end = state.num_slots + len(prefix) * self.block_size + num_new_tokens
        num_fresh = self.num_blocks_needed(end) - state.num_entries - len(prefix)
        cow = num_new_tokens > 0 and self._shares_partial_block(state)
        if not self.can_allocate(self._blocks_to_take(state, num_new_tokens, prefix)):
            return False
        self._add_prefix(state, prefix)
        if cow:
            self._copy_on_write(state)
        for _ in range(num_fresh):
            state.append(self.pool.allocate().block_id)
        state.num_slots = end
        if is_new:
            self._seqs[seq_id] = state
            self._count_prefix_query(len(token_ids), len(prefix))
        return True

    def can_extend(self, seq_id: int, num_new_tokens: int, cached_prefix: list[Block | None] | None = None) -> bool:
        """Whether `allocate` with these arguments would find its blocks (it changes nothing)."""
        state = self._seqs.get(seq_id) or _SeqState()
        return self.can_allocate(self._blocks_to_take(state, num_new_tokens, cached_prefix or []))

    def _blocks_to_take(self, state: _SeqState, num_new_tokens: int, prefix: list[Block | None]) -> int:
        """Free blocks an allocation takes: fresh ones, a copy-on-write copy, and revived prefix blocks
        (which leave the free queue too)."""
        end = state.num_slots + len(prefix) * self.block_size + num_new_tokens
        num_fresh = self.num_blocks_needed(end) - state.num_entries - len(prefix)
        cow = num_new_tokens > 0 and self._shares_partial_block(state)
        return num_fresh + cow + sum(1 for b in prefix if b is not None and b.ref_count == 0)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Makes `child_id` share every block of `parent_id` (copy-on-write on later appends)."""
        if child_id in self._seqs:
            raise ValueError(f"fork: sequence {child_id} already exists")
        child = self._state(parent_id).copy()
        for block_id in child.live_blocks:
            self.pool.touch(self.pool.blocks[block_id])
        self._seqs[child_id] = child

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Returns and clears the (src_block_id, dst_block_id) copies due before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_key: Hashable = None) -> None:
        """Registers the chain hash of every newly computed full block of the sequence."""
        if not self.enable_prefix_caching:
            return
        state = self._state(seq_id)
        if not 0 <= num_computed_tokens <= min(state.num_slots, len(token_ids)):
            raise ValueError(f"sequence {seq_id}: num_computed_tokens {num_computed_tokens} is beyond "
                             f"its {state.num_slots} slots or {len(token_ids)} tokens")
        bs = self.block_size
        for i in range(state.num_hashed, num_computed_tokens // bs):
            chunk = token_ids[i * bs:(i + 1) * bs]
            state.last_hash = hash_block(state.last_hash, chunk, extra_key)
            if i in state.blocks:
                self.pool.cache(self.pool.blocks[state.blocks[i]], state.last_hash, chunk)
            state.num_hashed = i + 1

    def free(self, seq_id: int) -> None:
        """Releases every block of the sequence, tail first (so tail blocks are evicted first)."""
        state = self._state(seq_id)
        del self._seqs[seq_id]
        for block_id in reversed(state.live_blocks):
            self.pool.release(self.pool.blocks[block_id])
        self._drop_dead_copies()

    def truncate(self, seq_id: int, num_slots: int) -> int:
        """Shrinks the table to cover `num_slots` slots (the K/V of rejected speculative tokens are
        taken back): blocks past the new end return to the pool. Returns how many went back.

        Hashed blocks hold verified tokens only, so the new end may not cut into them."""
        state = self._state(seq_id)
        if not state.num_hashed * self.block_size <= num_slots <= state.num_slots:
            raise ValueError(f"sequence {seq_id}: cannot truncate to {num_slots} slots (it covers "
                             f"{state.num_slots}, {state.num_hashed} blocks hashed)")
        keep = self.num_blocks_needed(num_slots)
        released = 0
        for i in range(state.num_entries - 1, keep - 1, -1):  # tail first: the tail is evicted first
            block_id = state.blocks.pop(i, None)
            if block_id is not None:
                self.pool.release(self.pool.blocks[block_id])
                released += 1
        state.num_entries, state.num_slots = keep, num_slots
        self._drop_dead_copies()
        return released

    def free_blocks_before(self, seq_id: int, num_tokens: int) -> int:
        """Sliding window: releases the blocks wholly before token `num_tokens`; returns how many.

        Their table entries become NULL_BLOCK, so later token indices keep their positions.
        """
        state = self._state(seq_id)
        if not 0 <= num_tokens <= state.num_slots:
            raise ValueError(f"sequence {seq_id}: num_tokens {num_tokens} outside 0..{state.num_slots}")
        return self.release_blocks(seq_id, range(num_tokens // self.block_size))

    def release_blocks(self, seq_id: int, block_indices: Iterable[int]) -> int:
        """Releases the given table entries (already-null ones are skipped); returns how many went back."""
        state = self._state(seq_id)
        released = 0
        for i in block_indices:
            if not 0 <= i < state.num_entries:
                raise ValueError(f"sequence {seq_id}: block index {i} outside its table")
            block_id = state.blocks.pop(i, None)
            if block_id is not None:
                self.pool.release(self.pool.blocks[block_id])
                released += 1
        self._drop_dead_copies()
        return released

    # -- helpers ----------------------------------------------------------------------------

    def _state(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}") from None

    def _check_allocate_args(self, state: _SeqState, num_tokens: int, token_ids: Sequence[int],
                             num_new_tokens: int, prefix: list[Block | None]) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if prefix and len(prefix) * self.block_size > len(token_ids) - 1:
            raise ValueError("cached_prefix must leave the last prompt token to compute")
        bs = self.block_size
        if any(b is not None and b.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]) for i, b in enumerate(prefix)):
            raise ValueError("cached_prefix does not match the tokens (evicted since find_cached_prefix?)")
        end = state.num_slots + len(prefix) * bs + num_new_tokens
        if end > num_tokens:
            raise ValueError(f"allocating up to slot {end} but the sequence has only {num_tokens} tokens")

    def _shares_partial_block(self, state: _SeqState) -> bool:
        """Whether the next write lands in a partially filled block that another table shares."""
        if state.num_slots % self.block_size == 0:
            return False
        return self.pool.blocks[state.last_block].ref_count > 1

    def _copy_on_write(self, state: _SeqState) -> None:
        """Gives the sequence a private copy of its last block; records where its rows come from."""
        src = self.pool.blocks[state.last_block]
        dst = self.pool.allocate()
        self.pool.release(src)
        state.blocks[state.num_entries - 1] = dst.block_id
        self._pending_copies.append((src.block_id, dst.block_id))

    def _add_prefix(self, state: _SeqState, prefix: list[Block | None]) -> None:
        """A prefix hit's blocks join the table; a None (a block no query of a window reads) stays NULL_BLOCK."""
        for i, block in enumerate(prefix):
            if block is not None:
                self.pool.touch(block)
                state.blocks[i] = block.block_id
        if prefix:
            state.num_entries = len(prefix)
            state.num_slots = len(prefix) * self.block_size
            state.num_hashed, state.last_hash = len(prefix), prefix[-1].block_hash

    def _count_prefix_query(self, num_prompt_tokens: int, num_prefix_blocks: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += num_prefix_blocks * self.block_size
            self.prefix_hit_blocks += num_prefix_blocks

    def _drop_dead_copies(self) -> None:
        """Forgets pending copies whose destination block was freed before the runner saw them."""
        self._pending_copies = [(s, d) for s, d in self._pending_copies if self.pool.blocks[d].ref_count > 0]

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Asserts pool and table bookkeeping agree (for tests and debug runs)."""
        self.pool.check_invariants()
        refs: Counter[int] = Counter()
        for seq_id, state in self._seqs.items():
            table = state.table
            assert len(table) == self.num_blocks_needed(state.num_slots), f"seq {seq_id}: table size"
            live = state.live_blocks
            assert all(0 <= b < self.num_blocks for b in live), f"seq {seq_id}: bad block id"
            assert state.num_hashed <= state.num_slots // self.block_size, f"seq {seq_id}: hashed a partial block"
            refs.update(live)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref_count != table refs"
        assert all(self.pool.blocks[d].ref_count > 0 for _, d in self._pending_copies), "copy into a free block"
        if not self._seqs:
            assert self.pool.num_free == self.num_blocks, "idle manager holds blocks"
