"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache hash map.

A block is `block_size` token slots of K/V in every layer (the runner owns the tensors; this
module only does the bookkeeping). Each block is in exactly one of two states:

    used  (ref_count > 0)   owned by one or more sequences' block tables
    free  (ref_count == 0)  in the free queue, in eviction order

A free block may still hold a hash: its contents are a reusable prefix ("cached-evictable").
A prefix hit revives it (`touch`) straight from the middle of the queue; `allocate` evicts
from the head, so the least recently freed block is reused first:

    free queue:  head -> [b7 h=..] [b2] [b9 h=..] [b4] <- tail (released last)
                  evicted first                     evicted last
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

# Stands in for a missing parent hash, so every hashed key is a tuple of ints (deterministic
# across runs: `hash(None)` is address-based before Python 3.12).
_NO_PARENT = 0x5EED


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
    """Chain hash of one full block: its parent's hash, its token ids and an optional extra key.

    The extra key covers anything else that changes the block's K/V (a cache policy that stores
    keys differently, a LoRA adapter, ...). Python's `hash` of a tuple of ints is the same in
    every run; an extra key of type `str` is salted per process, which is fine for a cache that
    lives in one process.
    """
    parent = _NO_PARENT if parent_hash is None else parent_hash
    key: tuple[Hashable, ...] = (parent, tuple(token_ids))
    if extra_key is not None:
        key += (extra_key,)
    return hash(key)


@dataclass(eq=False)
class Block:
    """One block of KV slots. `token_ids` is kept with the hash to guard against hash collisions."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None

    def forget_hash(self) -> None:
        """Called on eviction: the block's slots are about to hold other tokens."""
        self.block_hash = None
        self.token_ids = None


class BlockPool:
    """`num_blocks` blocks with reference counts, an O(1) LRU free queue and a hash -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block, head first; OrderedDict gives O(1) pop-head, append and remove-middle.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, int] = {}  # hash -> block id (ids, so that listing them is one C-level pass)
        self._num_cached_free = 0

    # -- counters ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with ref_count 0, cached-evictable ones included: what `allocate` can supply."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a hash (a prefix hit can revive them)."""
        return self._num_cached_free

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks in the hash map, used or free."""
        return len(self._cached)

    def hashed_block_ids(self) -> np.ndarray:
        """[num_cached] int64: ids of the blocks in the hash map, used or free."""
        return np.fromiter(self._cached.values(), np.int64, count=len(self._cached))

    # -- operations -------------------------------------------------------------------------

    def allocate(self) -> Block:
        """Takes the least recently freed block (evicting its hash, if any) with ref_count 1."""
        if not self._free:
            raise RuntimeError("BlockPool.allocate: no free block")
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            self._num_cached_free -= 1
            self._uncache(block)
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Adds a reference (a prefix hit or a fork); a free block leaves the free queue."""
        if block.ref_count == 0:
            del self._free[block.block_id]
            if block.block_hash is not None:
                self._num_cached_free -= 1
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drops a reference; at zero the block joins the tail of the free queue, hash kept."""
        if block.ref_count <= 0:
            raise RuntimeError(f"BlockPool.release: block {block.block_id} is already free")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.block_hash is not None:
                self._num_cached_free += 1

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block with this hash, only if it holds exactly these tokens (collision guard)."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return self.blocks[block_id]

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Registers a used, full block under `block_hash`; returns whether it was registered.

        Nothing happens when prefix caching is off, when the block already has a hash (its
        contents never change once full), or when another block holds the hash (a duplicate
        computed concurrently, or a collision: the first block wins).
        """
        if block.ref_count <= 0:
            raise RuntimeError(f"BlockPool.cache: block {block.block_id} is free")
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block.block_id
        return True

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None and self._cached[block.block_hash] == block.block_id
        del self._cached[block.block_hash]
        block.forget_hash()

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Asserts the pool's bookkeeping is consistent (for tests and debug runs)."""
        zero_ref = {b.block_id for b in self.blocks if b.ref_count == 0}
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref_count"
        assert set(self._free) == zero_ref, "free queue != blocks with ref_count 0"
        assert all(self._free[i] is self.blocks[i] for i in self._free), "free queue holds foreign blocks"
        assert self.num_free + self.num_used == self.num_blocks, "free + used != total"
        cached_free = sum(1 for b in self._free.values() if b.block_hash is not None)
        assert cached_free == self._num_cached_free, "cached-free counter out of sync"
        for block_hash, block_id in self._cached.items():
            block = self.blocks[block_id]
            assert block.block_hash == block_hash, "hash map key != block's hash"
            assert block.token_ids is not None, "cached block without token ids"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert all(self._cached.get(b.block_hash) == b.block_id for b in hashed), "hashed block missing from the map"
        assert self.enable_prefix_caching or not self._cached, "cache used while prefix caching is off"
