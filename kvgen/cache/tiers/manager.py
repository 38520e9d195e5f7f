"""The KV manager with tiers below its pool, and the tiers themselves.

`TieredKVManager` is the plain `KVCacheManager` with three additions:

    eviction   a cached block the pool hands out again is copied to the tiers first (`_TierPool`)
    hashing    each block it caches gets a chain digest (stable across processes, the tiers' key);
               with a disk tier, the block is written through to disk then (so a restart finds it)
    lookup     `find_cached_prefix` continues past the pool's chain into the tiers: the blocks found
               there are copied into fresh pool blocks and cached, and join the prefix as hits

Everything runs between steps (the scheduler's lookups and allocations), when no forward pass reads
or writes the pools, so a copy out of an evicted block always precedes any write into it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvgen.cache.block_pool import Block, BlockPool, hash_block
from kvgen.cache.kv_manager import KVCacheManager
from kvgen.cache.tiers.disk import DiskTier
from kvgen.cache.tiers.host import HostTier

log = logging.getLogger(__name__)


def chain_digest(parent: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None) -> bytes:
    """16 bytes naming a full block by its whole prefix: its parent's digest, its tokens, the extra key."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)  # None: the root of a model without kinds
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


@dataclass
class TierCounters:
    """Per tier: blocks stored, blocks served back (hits), bytes moved each way, seconds spent."""

    stored: int = 0
    hits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


@dataclass
class Tiers:
    """The host tier (RAM) over the disk tier; either may be absent."""

    host: HostTier | None = None
    disk: DiskTier | None = None
    counters: dict[str, TierCounters] = field(default_factory=lambda: {"host": TierCounters(), "disk": TierCounters()})
    pinned: set[bytes] = field(default_factory=set)

    def __contains__(self, digest: bytes) -> bool:
        return (self.host is not None and digest in self.host) or (self.disk is not None and digest in self.disk)

    def put(self, digest: bytes, token_ids: tuple[int, ...], payload) -> None:
        """An evicted block: into the host tier (what that pushes out goes to disk), else to disk."""
        if self.host is not None:
            started = time.perf_counter()
            pushed = self.host.put(digest, token_ids, payload, self.pinned)
            c = self.counters["host"]
            c.stored += 1
            c.bytes_in += payload.numel()
            c.seconds += time.perf_counter() - started
            for d, tokens, data in pushed:
                self.write_disk(d, tokens, data)
        else:
            self.write_disk(digest, token_ids, payload)

    def write_disk(self, digest: bytes, token_ids: tuple[int, ...], payload) -> None:
        if self.disk is None or not self.disk.enabled or digest in self.disk:
            return
        started = time.perf_counter()
        self.disk.put(digest, token_ids, payload, self.pinned)
        c = self.counters["disk"]
        if digest in self.disk:
            c.stored += 1
            c.bytes_in += payload.numel()
        c.seconds += time.perf_counter() - started

    def readings(self) -> tuple[tuple[str, dict[str, float]], ...]:
        """Per tier present: blocks and bytes held, its budget, whether it is on (a disk tier turns off on
        a write error), and its counters (EngineStats.kv_tiers)."""
        out = []
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is not None:
                c = self.counters[name]
                out.append((name, {"blocks": len(tier), "bytes": tier.nbytes, "capacity": tier.capacity,
                                   "enabled": getattr(tier, "enabled", True), "hits": c.hits, "bytes_in": c.bytes_in,
                                   "bytes_out": c.bytes_out, "seconds": c.seconds, "stored": c.stored}))
        return tuple(out)

    def get(self, digest: bytes, token_ids: tuple[int, ...]):
        """The block's payload from the nearest tier that has it intact, or None."""
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None or digest not in tier:
                continue
            started = time.perf_counter()
            payload = tier.get(digest, token_ids)
            c = self.counters[name]
            c.seconds += time.perf_counter() - started
            if payload is not None:
                c.hits += 1
                c.bytes_out += payload.numel()
                if name == "disk" and self.host is not None:
                    self.put(digest, token_ids, payload)
                return payload
        return None


class _TierPool(BlockPool):
    """A block pool that tells its manager which cached block it is about to evict."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool, on_evict) -> None:
        super().__init__(num_blocks, enable_prefix_caching)
        self.on_evict = on_evict

    def allocate(self) -> Block:
        if self._free:
            head = next(iter(self._free.values()))
            if head.block_hash is not None:
                self.on_evict(head)
        return super().allocate()


class TieredKVManager(KVCacheManager):
    """A `KVCacheManager` whose evicted prefix blocks go to `tiers` and come back from them. The pools'
    bytes are reached through `io` (kvgen.cache.tiers.pool_io.PoolIO), attached once they exist."""

    def __init__(self, num_blocks: int, block_size: int, tiers: Tiers, root: bytes = b"root") -> None:
        """`root`: where every chain digest starts (a hybrid model's kinds share the tiers, each its own root)."""
        super().__init__(num_blocks, block_size, True)
        self.pool = _TierPool(num_blocks, True, self._evicted)
        self.tiers, self.root = tiers, root
        self.io = None
        self._digest_of: dict[int, bytes] = {}  # hashed block id -> its chain digest
        self._seq_digest: dict[int, tuple[int, bytes]] = {}  # seq -> (blocks digested, last digest)
        self.tier_hit_blocks = 0

    def attach(self, io) -> None:
        self.io = io

    # -- eviction and hashing -------------------------------------------------------------------

    def _evicted(self, block: Block) -> None:
        digest = self._digest_of.pop(block.block_id, None)
        if digest is None or self.io is None or (self.tiers.host is None and digest in self.tiers):
            return
        self.tiers.put(digest, block.token_ids, self.io.read(block.block_id))

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_key: Hashable = None) -> None:
        super().cache_full_blocks(seq_id, token_ids, num_computed_tokens, extra_key)
        state = self._state(seq_id)
        done, digest = self._seq_digest.get(seq_id, (0, self.root))
        bs = self.block_size
        for i in range(done, state.num_hashed):
            chunk = token_ids[i * bs:(i + 1) * bs]
            digest = chain_digest(digest, chunk, extra_key)
            block_id = state.blocks.get(i)
            if block_id is None or self.pool.blocks[block_id].block_hash is None:
                continue
            if block_id not in self._digest_of:
                self._digest_of[block_id] = digest
                self._write_through(block_id, digest, tuple(chunk))
        self._seq_digest[seq_id] = (state.num_hashed, digest)

    def _write_through(self, block_id: int, digest: bytes, token_ids: tuple[int, ...]) -> None:
        """With a disk tier, a block is written as soon as it is cached: a restart finds it."""
        disk = self.tiers.disk
        if self.io is not None and disk is not None and disk.enabled and digest not in disk:
            self.tiers.write_disk(digest, token_ids, self.io.read(block_id))

    def fork(self, parent_id: int, child_id: int) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self._seq_digest:
            self._seq_digest[child_id] = self._seq_digest[parent_id]

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._seq_digest.pop(seq_id, None)

    # -- lookup ---------------------------------------------------------------------------------

    def cached_blocks(self, token_ids: Sequence[int], extra_key: Hashable = None, count: int | None = None,
                      start: int = 0) -> list[Block | None]:
        """The pool's blocks, after the tiers' blocks from `start` on (up to the first block neither
        holds) are copied into fresh pool blocks and cached: the pool then holds them as cached blocks
        whether or not the caller allocates. `find_cached_prefix` asks from the first block, so a
        prompt's prefix continues past the pool's chain into the tiers."""
        blocks = super().cached_blocks(token_ids, extra_key, count)
        if self.io is None or None not in blocks[start:]:
            return blocks
        wanted, digest, block_hash, bs = [], self.root, None, self.block_size
        for i, block in enumerate(blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            digest, block_hash = chain_digest(digest, chunk, extra_key), hash_block(block_hash, chunk, extra_key)
            if i < start or block is not None:
                continue
            if digest not in self.tiers:
                break
            wanted.append((digest, chunk, block_hash))
        if not wanted:
            return blocks
        self._load([b for b in blocks[start:] if b is not None], wanted)
        return super().cached_blocks(token_ids, extra_key, count)

    def _load(self, held: list[Block], wanted: list[tuple[bytes, tuple[int, ...], int]]) -> None:
        """Copies the tiers' blocks (digest, tokens, pool hash) into fresh pool blocks, cached under the
        pool's hash, in order until one is missing or the pool has no room."""
        for block in held:  # held while fresh blocks are taken, so that none of them is evicted
            self.pool.touch(block)
        loaded: list[Block] = []
        payloads = []
        try:
            room = self.pool.num_free - 1  # one block left for the prompt's last tokens
            for digest, chunk, block_hash in wanted[:max(room, 0)]:
                payload = self.tiers.get(digest, chunk)
                if payload is None:
                    break
                block = self.pool.allocate()  # an eviction here copies the evicted block out first
                if not self.pool.cache(block, block_hash, chunk):
                    self.pool.release(block)
                    break
                self._digest_of[block.block_id] = digest
                loaded.append(block)
                payloads.append(payload)
            self.io.write_many([b.block_id for b in loaded], payloads)  # after every eviction's copy
        finally:
            for block in reversed(held + loaded):
                self.pool.release(block)
        self.tier_hit_blocks += len(loaded)

    # -- pins -----------------------------------------------------------------------------------

    def pin(self, token_ids: Sequence[int], extra_key: Hashable = None, pin: bool = True) -> dict[str, int]:
        """Pins (or unpins) the prompt's full blocks in the tiers: pinned blocks are never pushed out of
        the host tier or the disk tier. Blocks the pool holds are copied to the tiers now. Returns the
        blocks pinned and how many of them a tier holds."""
        digests = self.digests(token_ids, extra_key)
        if not pin:
            self.tiers.pinned.difference_update(digests)
            return {"blocks": len(digests), "stored": 0}
        self.tiers.pinned.update(digests)
        pooled = KVCacheManager.cached_blocks(self, list(token_ids) + [0], extra_key)  # every full block, the last too
        for block, digest in zip(pooled, digests):
            if self.io is None:
                break
            if block is None:
                continue
            if self.tiers.host is not None and digest not in self.tiers.host:
                self.tiers.put(digest, block.token_ids, self.io.read(block.block_id))
            elif self.tiers.host is None:
                self.tiers.write_disk(digest, block.token_ids, self.io.read(block.block_id))
        return {"blocks": len(digests), "stored": sum(1 for d in digests if d in self.tiers)}

    def digests(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[bytes]:
        """The chain digests of a prompt's full blocks."""
        out, digest, bs = [], self.root, self.block_size
        for i in range(len(token_ids) // bs):
            digest = chain_digest(digest, token_ids[i * bs:(i + 1) * bs], extra_key)
            out.append(digest)
        return out
