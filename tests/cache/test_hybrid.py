"""The hybrid KV cache's bookkeeping: one manager per kind of layer, answering as one."""

from kvgen.cache.hybrid import HybridKVManager, LayerKind, layer_kinds, sequence_bytes, split_budget
from kvgen.cache.kv_manager import KVCacheManager

KINDS = [LayerKind(None, (2,)), LayerKind(4, (0, 1, 3))]


def hybrid(global_blocks: int = 16, window_blocks: int = 16) -> HybridKVManager:
    return HybridKVManager([KVCacheManager(global_blocks, 2), KVCacheManager(window_blocks, 2)], KINDS, chunk=4)


def test_layers_grouped_by_window_global_first():
    assert layer_kinds([4, 4, None, 4]) == KINDS
    assert layer_kinds([8, None, 4, None]) == [LayerKind(None, (1, 3)), LayerKind(4, (2,)), LayerKind(8, (0,))]


def test_the_budget_follows_what_a_sequence_holds_in_each_kind():
    needs = sequence_bytes(KINDS, 100, max_len=1000, chunk=4, block_size=2)
    assert needs == [1 * 100 * 1000, 3 * 100 * (4 + 4 + 4)]
    assert split_budget(1_000_000, needs) == [1_000_000 * needs[0] // sum(needs), 1_000_000 * needs[1] // sum(needs)]


def test_an_allocation_takes_blocks_in_every_kind_or_none():
    kv = hybrid(global_blocks=16, window_blocks=3)
    tokens = list(range(10))
    assert not kv.allocate(1, tokens, 8)  # 4 blocks: the windowed pool has 3
    assert kv.num_used_blocks == 0 and 1 not in kv
    assert kv.allocate(1, tokens, 6)
    assert [k.num_used_blocks for k in kv.kinds] == [3, 3]
    kv.check_invariants()


def test_sliding_gives_back_the_windowed_blocks_only():
    kv = hybrid()
    tokens = list(range(12))
    assert kv.allocate(1, tokens, 12)
    kv.slide(1, 12)  # queries from token 12 on read tokens 9.. (window 4): blocks 0-3 are dead
    assert kv.kinds[0].num_live_blocks(1) == 6 and kv.kinds[1].num_live_blocks(1) == 2
    assert kv.fits(1000) is False and kv.fits(30)  # the global pool bounds a sequence
    kv.free(1)
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_a_prefix_hit_is_what_every_kind_still_has():
    kv = hybrid()
    tokens = list(range(12))
    assert kv.allocate(1, tokens, 12)
    kv.cache_full_blocks(1, tokens, 12)
    kv.free(1)
    hit = kv.find_cached_prefix(tokens)
    assert len(hit) == 5  # the last token is always recomputed
    assert kv.allocate(2, tokens, 12 - 5 * 2, cached_prefix=hit)
    assert kv.prefix_hits == 10
    kv.free(2)
    kv.check_invariants()


def test_a_prefix_hit_needs_of_a_windowed_kind_only_the_blocks_its_window_reads():
    kv = hybrid(global_blocks=16, window_blocks=8)
    tokens = list(range(12))
    assert kv.allocate(1, tokens, 12)
    kv.cache_full_blocks(1, tokens, 12)
    kv.slide(1, 12)  # window blocks 0-3 go back first, so they are evicted first
    kv.free(1)
    assert kv.allocate(2, [100 + t for t in range(8)], 8)  # takes the 2 unused window blocks, then 0 and 1
    kv.free(2)
    assert [b is not None for b in kv.kinds[1].cached_blocks(tokens)] == [False, False, True, True, True]
    hit = kv.find_cached_prefix(tokens)  # the query at token 10 reads tokens 7.. (window 4): blocks 3 and 4
    assert len(hit) == 5 and [w is None for _, w in hit] == [True, True, True, False, False]
    assert kv.allocate(3, tokens, 2, cached_prefix=hit)
    assert kv.kinds[1].block_table(3)[:3] == [-1, -1, -1] and kv.kinds[1].num_live_blocks(3) == 3
    assert kv.prefix_hits == 10
    kv.free(3)
    kv.check_invariants()
    assert kv.allocate(4, [200 + t for t in range(16)], 16)  # every window block taken: nothing to read
    kv.free(4)
    assert kv.find_cached_prefix(tokens) == [] and len(kv.kinds[0].find_cached_prefix(tokens)) == 5


def test_a_fork_copies_its_shared_partial_block_in_every_kind():
    kv = hybrid()
    tokens = list(range(3))
    assert kv.allocate(1, tokens, 3)
    kv.fork(1, 2)
    assert kv.allocate(2, tokens + [9], 1)  # writes into the shared half-full block: copy-on-write
    copies = kv.take_pending_copies()
    assert [len(c) for c in copies] == [1, 1]
    assert kv.take_pending_copies() == [[], []]
