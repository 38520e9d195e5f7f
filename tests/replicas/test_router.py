"""The routers alone (no processes): prefix matches by the prefix cache's own chain hashes, the load
threshold, round-robin, and the cores each replica gets."""

import pytest

from kvgen.cache.kv_manager import KVCacheManager
from kvgen.errors import KVGenError
from kvgen.replicas.launch import assign_cores
from kvgen.replicas.router import PrefixRouter, RoundRobinRouter, prefix_hashes

BS = 4


def test_prefix_hashes_are_the_prefix_caches_own():
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks the cache may serve ((18 - 1) // 4)
    kv = KVCacheManager(16, BS, True)
    assert kv.allocate(0, prompt, len(prompt))
    kv.cache_full_blocks(0, prompt, len(prompt))
    hashes = prefix_hashes(prompt, BS)
    assert len(hashes) == 4
    assert [b.block_hash for b in kv.find_cached_prefix(prompt)] == hashes


def test_longest_prefix_wins_unless_loaded():
    router = PrefixRouter(3, BS, load_threshold=2)
    a = list(range(100, 117))
    b = list(range(200, 217))
    assert router.choose(a, [0, 0, 0], [True] * 3) == (0, "load")  # nothing known: least loaded
    assert router.choose(b, [1, 0, 0], [True] * 3) == (1, "load")
    assert router.choose(a + [7, 8], [1, 1, 0], [True] * 3) == (0, "prefix")  # a's blocks are on replica 0
    assert router.choose(b[:9] + [5, 5, 5, 5], [1, 1, 0], [True] * 3) == (1, "prefix")  # 2 blocks of b
    assert router.choose(a, [2, 0, 0], [True] * 3)[1] == "load"  # replica 0 at the threshold
    assert router.choose(a, [0, 0, 0], [False, True, True])[0] in (1, 2)  # a dead replica is never chosen
    router.forget(1)  # replica 1 restarted: b's blocks are nowhere any more
    assert router.choose(b, [3, 3, 0], [True] * 3) == (2, "load")


def test_round_robin_skips_dead_replicas():
    router = RoundRobinRouter(3)
    assert [router.choose([1], [0] * 3, [True, False, True])[0] for _ in range(4)] == [0, 2, 0, 2]


def test_cores():
    assert assign_cores(2, None, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert assign_cores(2, 1, [4, 5]) == [[4], [5]]
    with pytest.raises(KVGenError, match="3 replicas x 1 threads need 3 cores, but this process may run on 2"):
        assign_cores(3, None, [0, 1])
    with pytest.raises(KVGenError, match="need 4 cores"):
        assign_cores(2, 2, [0, 1])
