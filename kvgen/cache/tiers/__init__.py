"""KV tiers below the block pool: a host-RAM tier and a disk tier for evicted cached-prefix blocks.

    pool  (the KV block pool: blocks sequences read and write)
      │  a cached prefix block evicted (full, hash-chained, no sequence holds it): its K/V copied out
      ▼
    host  (a bounded region of RAM, LRU: --kv-offload-memory)
      │  evicted from the host tier (and every block as it is cached, when a disk tier is set)
      ▼
    disk  (one file per block in --kv-cache-dir, LRU within --kv-cache-disk; survives restarts)

A prompt whose prefix misses the pool but hits a tier gets those blocks copied back into fresh pool
blocks before it is scheduled, and they count as computed tokens (kvgen.cache.tiers.manager).
Blocks are keyed by a chain digest of their tokens (stable across processes, unlike the pool's
`hash`), and on disk by the model's identity too (kvgen.cache.tiers.identity).
"""

from kvgen.cache.tiers.manager import Tiers, TieredKVManager, chain_digest

__all__ = ["Tiers", "TieredKVManager", "chain_digest"]
