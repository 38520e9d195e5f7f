"""BlockPool: reference counts, LRU eviction of cached free blocks, the collision guard."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.cache.block_pool import BlockPool, hash_block


def test_hash_block_is_a_chain_over_parent_tokens_and_extra_key():
    h = hash_block(None, [1, 2, 3])
    assert h == hash_block(None, (1, 2, 3))
    assert h != hash_block(None, [1, 2, 4])
    assert hash_block(h, [5]) != hash_block(hash_block(None, [9]), [5])
    assert hash_block(None, [1, 2, 3], extra_key="int8-keys") != h


def test_allocate_release_counts():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert (a.ref_count, pool.num_used, pool.num_free) == (1, 2, 2)
    pool.touch(a)
    pool.release(a)
    assert a.ref_count == 1 and pool.num_used == 2
    pool.release(a)
    pool.release(b)
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (0, 4, 0)
    pool.check_invariants()


def test_release_of_a_free_block_and_exhaustion_raise():
    pool = BlockPool(1)
    block = pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release(block)
    with pytest.raises(RuntimeError):
        pool.release(block)
    with pytest.raises(RuntimeError):
        pool.cache(block, 1, [1])


def test_lru_eviction_oldest_freed_first_and_a_hit_survives():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        assert pool.cache(block, 100 + i, [i])
    for block in blocks:  # freed in order 0, 1, 2: all cached-evictable
        pool.release(block)
    assert pool.num_cached_free == 3
    hit = pool.lookup(101, [1])
    assert hit is blocks[1]
    pool.touch(hit)  # revived from the middle of the free queue
    assert (pool.num_free, pool.num_cached_free) == (2, 2)
    first = pool.allocate()
    assert first is blocks[0] and first.block_hash is None
    assert pool.lookup(100, [0]) is None  # evicted
    pool.release(hit)  # now the most recently freed
    assert pool.allocate() is blocks[2]
    assert pool.allocate() is blocks[1]
    pool.check_invariants()


def test_collision_guard_needs_equal_tokens():
    pool = BlockPool(2)
    a = pool.allocate()
    assert pool.cache(a, 7, [1, 2])
    assert pool.lookup(7, [1, 2]) is a
    assert pool.lookup(7, [3, 4]) is None  # same hash, other tokens: no false hit
    b = pool.allocate()
    assert not pool.cache(b, 7, [3, 4])  # the first block keeps the hash
    assert b.block_hash is None
    assert not pool.cache(a, 8, [1, 2])  # a full block's hash never changes
    pool.check_invariants()


def test_prefix_caching_off_caches_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    block = pool.allocate()
    assert not pool.cache(block, 1, [1])
    assert pool.lookup(1, [1]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "touch", "release", "cache", "hit"]), st.integers(0, 7)),
                max_size=60))
def test_random_operations_keep_invariants(ops):
    pool = BlockPool(6)
    refs: list = []  # one entry per reference held
    for op, arg in ops:
        if op == "alloc" and pool.num_free:
            refs.append(pool.allocate())
        elif op == "touch" and refs:
            block = refs[arg % len(refs)]
            pool.touch(block)
            refs.append(block)
        elif op == "release" and refs:
            pool.release(refs.pop(arg % len(refs)))
        elif op == "cache" and refs:
            pool.cache(refs[arg % len(refs)], arg % 4, [arg % 4])
        elif op == "hit":
            block = pool.lookup(arg % 4, [arg % 4])
            if block is not None:
                pool.touch(block)
                refs.append(block)
        pool.check_invariants()
        assert pool.num_used == len({id(b) for b in refs})
    for block in refs:
        pool.release(block)
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)
