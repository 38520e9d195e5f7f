"""Which replica serves a request.

`PrefixRouter` sends a prompt to the replica most likely to hold its longest prefix in its prefix
cache, judged by the same chain hashes the cache uses (kvgen.cache.block_pool.hash_block over
block_size-token chunks, at most (len - 1) // block_size of them, as KVCacheManager.find_cached_prefix
looks them up). It does not ask the replicas what they hold: per replica it remembers the chain hashes
of the prompts it routed there (a bounded LRU set), which is what that replica's cache holds unless
it has evicted them since. A replica whose load (requests in flight) has reached `load_threshold` is
passed over: the request then goes to the least loaded replica, as does one that matches nowhere.

`RoundRobinRouter` takes the live replicas in turn (the baseline the prefix router is measured
against).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvgen.cache.block_pool import hash_block

DEFAULT_HASHES_PER_REPLICA = 65536  # chain hashes remembered per replica (~ 1M tokens at 16-token blocks)


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the prompt's full blocks that the prefix cache can serve (not the last token)."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixRouter:
    name = "prefix"

    def __init__(self, num_replicas: int, block_size: int, load_threshold: int,
                 capacity: int = DEFAULT_HASHES_PER_REPLICA) -> None:
        self.block_size = block_size
        self.load_threshold = load_threshold
        self.capacity = capacity
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = itertools.count()  # ties in load go round the replicas, so light traffic spreads

    def choose(self, token_ids: Sequence[int], loads: Sequence[int], live: Sequence[bool]) -> tuple[int, str]:
        """(replica, reason): "prefix" for the replica holding the longest prefix, "load" for the least
        loaded one. At least one replica must be live."""
        candidates = [i for i, up in enumerate(live) if up]
        hashes = prefix_hashes(token_ids, self.block_size)
        best, best_blocks = None, 0
        for i in candidates:
            n = 0
            for h in hashes:
                if h not in self.seen[i]:
                    break
                n += 1
            if n > best_blocks or (n == best_blocks and n and loads[i] < loads[best]):
                best, best_blocks = i, n
        if best is not None and loads[best] < self.load_threshold:
            choice, reason = best, "prefix"
        else:
            turn = next(self._turn)
            choice = min(candidates, key=lambda i: (loads[i], (i - turn) % len(self.seen)))
            reason = "load"
        self._remember(choice, hashes)
        return choice, reason

    def forget(self, replica: int) -> None:
        """A replica that restarted holds nothing."""
        self.seen[replica].clear()

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self.seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))
        self.num_replicas = num_replicas

    def choose(self, token_ids: Sequence[int], loads: Sequence[int], live: Sequence[bool]) -> tuple[int, str]:
        for _ in range(self.num_replicas):
            i = next(self._next)
            if live[i]:
                return i, "round_robin"
        raise RuntimeError("no live replica")

    def forget(self, replica: int) -> None:
        pass
