"""A recurrent model's state slots as the scheduler hands them out: one per running sequence, taken at
admission, given back on finish, abort and preemption (a preempted sequence recomputes on resume),
copied on fork; and the prefix cache's state snapshots (kvgen.cache.state_pool).

Prefix caching. The paged KV of an attention layer can be reused from any block boundary, but a
recurrent layer's state exists only where a step stopped. So a prompt is computed in chunks that end
at snapshot boundaries, every `snapshot_every` (256) tokens and at its last full block, and after
such a chunk the sequence's state is copied as a snapshot under that block's chain hash (the prefix
cache's, kvgen.cache.block_pool.hash_block). A later prompt whose cached blocks reach a boundary
with a snapshot takes the blocks up to it and the snapshot (one copy of the state); cached blocks
past the last snapshot are recomputed. Snapshots are evicted least recently used, apart from blocks:
a snapshot whose blocks were evicted is never found, since a hit starts from the KV cache's blocks.

An n > 1 request takes its children's slots at admission, so that forking its prompt never waits.
"""

from __future__ import annotations

from kvgen.cache.block_pool import Block, hash_block
from kvgen.cache.state_pool import StatePool
from kvgen.scheduling.sequence import Sequence

SNAPSHOT_EVERY = 256  # tokens between snapshot boundaries of a long prompt


class StateSlots:
    """The slots of `pool` by sequence, and its snapshots at block boundaries of `block_size` tokens."""

    def __init__(self, pool: StatePool, block_size: int, prefix_caching: bool,
                 snapshot_every: int = SNAPSHOT_EVERY) -> None:
        if snapshot_every % block_size:
            raise ValueError(f"snapshots every {snapshot_every} tokens fall inside blocks of {block_size}")
        self.pool, self.block_size, self.snapshot_every = pool, block_size, snapshot_every
        self.snapshots = prefix_caching and pool.num_snapshot_rows > 0

    # -- admission, release, fork ---------------------------------------------------------------

    def can_admit(self, seq: Sequence) -> bool:
        """Whether the pool has a slot for `seq` and for the children it will fork."""
        return self.pool.num_free >= len(self._family_without_slots(seq))

    def usable_prefix(self, seq: Sequence, cached: list[Block]) -> list[Block]:
        """The longest part of `cached` (the prefix cache's blocks of `seq`) that ends where a snapshot
        of the state is kept: the blocks a hit may take."""
        if not self.snapshots:
            return []
        for n in range(len(cached), 0, -1):
            if self.pool.has_snapshot(cached[n - 1].block_hash, cached[n - 1].token_ids):
                return cached[:n]
        return []

    def admit(self, seq: Sequence, prefix: list[Block]) -> None:
        """Slots for `seq` (and its children-to-be); `prefix` (from usable_prefix) is restored into its own."""
        for member in self._family_without_slots(seq):
            member.state_slot = self.pool.allocate()
        if prefix:
            last = prefix[-1]
            self.pool.restore_snapshot(last.block_hash, seq.state_slot, last.token_ids)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child continues from the parent's state (its slot, taken at admission, becomes the copy)."""
        if child.state_slot is not None:
            self.pool.free(child.state_slot)
        child.state_slot = self.pool.fork(parent.state_slot)

    def release(self, seq: Sequence) -> None:
        """Gives back the slot of a sequence that finished, was aborted or preempted."""
        if seq.state_slot is not None:
            self.pool.free(seq.state_slot)
            seq.state_slot = None

    def _family_without_slots(self, seq: Sequence) -> list[Sequence]:
        family = [seq] + ([s for s in seq.request.sequences[1:] if s.status.value == "waiting"] if seq.index == 0
                          and not seq.output_token_ids else [])
        return [s for s in family if s.state_slot is None]

    # -- snapshots ------------------------------------------------------------------------------

    def chunk_limit(self, seq: Sequence, start: int) -> int | None:
        """Most tokens to compute from `start` so that the chunk ends at the next snapshot boundary."""
        if not self.snapshots or not seq.policy.shares_prefixes:
            return None
        last = self._last_boundary(seq)
        if start >= last:
            return None
        return min(last, (start // self.snapshot_every + 1) * self.snapshot_every) - start

    def after_chunk(self, seq: Sequence) -> None:
        """Keeps a snapshot of `seq`'s state if its computed tokens now end at a snapshot boundary."""
        end, last = seq.num_computed_tokens, self._last_boundary(seq)
        at_boundary = 0 < end <= last and (end % self.snapshot_every == 0 or end == last)
        if not (self.snapshots and seq.policy.shares_prefixes and at_boundary and seq.state_slot is not None):
            return
        parent, bs = None, self.block_size
        for i in range(end // bs):
            block = seq.token_ids[i * bs:(i + 1) * bs]
            parent = hash_block(parent, block, seq.policy.prefix_key)
        self.pool.save_snapshot(seq.state_slot, parent, end, block)

    def _last_boundary(self, seq: Sequence) -> int:
        """The end of the last full block a later prompt can take from the prefix cache (never the last token)."""
        return (seq.num_tokens - 1) // self.block_size * self.block_size
