"""KVCacheManager: block tables, prefix reuse, copy-on-write, sliding windows, and a stateful model check."""

from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvgen.cache.block_pool import hash_block
from kvgen.cache.kv_manager import NULL_BLOCK, KVCacheManager


def prefill(mgr: KVCacheManager, seq_id: int, tokens: list[int]) -> list:
    """Allocates a whole prompt (with its cached prefix) and marks it computed."""
    prefix = mgr.find_cached_prefix(tokens)
    assert mgr.allocate(seq_id, tokens, len(tokens) - len(prefix) * mgr.block_size, prefix)
    mgr.cache_full_blocks(seq_id, tokens, len(tokens))
    return prefix


def append(mgr: KVCacheManager, seq_id: int, tokens: list[int], token: int) -> bool:
    """One decode step: the new token gets a slot, then counts as computed."""
    tokens.append(token)
    ok = mgr.allocate(seq_id, tokens, 1)
    if ok:
        mgr.cache_full_blocks(seq_id, tokens, len(tokens))
    else:
        tokens.pop()
    return ok


def snapshot(mgr: KVCacheManager, seq_ids) -> tuple:
    """Everything an allocation may change (peeks at private state: pending copies, LRU order)."""
    blocks = [(b.ref_count, b.block_hash) for b in mgr.pool.blocks]
    tables = {s: (mgr.block_table(s), mgr.num_slots(s)) for s in seq_ids if s in mgr}
    return (tables, blocks, mgr.num_free_blocks, mgr.num_cached_free_blocks, mgr.prefix_hits,
            mgr.prefix_queries, list(mgr._pending_copies), list(mgr.pool._free))


# -- unit tests ------------------------------------------------------------------------------


def test_block_table_grows_with_tokens():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(6))
    assert mgr.num_blocks_needed(6) == 2 and mgr.can_allocate(8) and not mgr.can_allocate(9)
    assert mgr.allocate(0, tokens, 6)
    assert len(mgr.block_table(0)) == 2 and mgr.num_slots(0) == 6
    for t in range(6, 9):
        assert append(mgr, 0, tokens, t)
    assert len(mgr.block_table(0)) == 3 and mgr.num_used_blocks == 3
    assert mgr.usage == 3 / 8
    mgr.check_invariants()


def test_prefix_hit_reuses_blocks_and_counts_hits():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    prefill(mgr, 0, system + [1, 2])
    assert (mgr.prefix_hits, mgr.prefix_queries) == (0, 14)
    prefix = prefill(mgr, 1, system + [7, 8, 9])
    assert [b.block_id for b in prefix] == mgr.block_table(0)[:3] == mgr.block_table(1)[:3]
    assert all(b.ref_count == 2 for b in prefix)
    assert (mgr.prefix_hits, mgr.prefix_queries, mgr.prefix_hit_blocks) == (12, 29, 3)
    assert mgr.prefix_hit_rate == pytest.approx(12 / 29)
    assert mgr.num_used_blocks == 4 + 1  # seq 1 adds one block for tokens 12..14
    mgr.check_invariants()


def test_prefix_survives_its_sequence_until_evicted():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    mgr.free(0)
    assert mgr.num_free_blocks == 4 and mgr.num_cached_free_blocks == 2
    prefix = prefill(mgr, 1, [1, 2, 3, 4, 9])
    assert len(prefix) == 2 and mgr.num_cached_free_blocks == 0
    mgr.free(1)
    mgr.check_invariants()


def test_blocks_computed_after_a_prefix_hit_extend_the_chain():
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    longer = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert len(prefill(mgr, 1, longer)) == 2
    table = mgr.block_table(1)
    mgr.free(0)
    mgr.free(1)
    assert [b.block_id for b in mgr.find_cached_prefix(longer + [0])] == table[:4]


def test_last_prompt_token_is_never_covered():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    prefill(mgr, 0, tokens + [8])
    assert len(mgr.find_cached_prefix(tokens + [8, 9])) == 2
    assert len(mgr.find_cached_prefix(tokens)) == 1  # 8 tokens: the second block holds the last one
    assert mgr.find_cached_prefix(tokens[:4]) == []
    assert mgr.find_cached_prefix([]) == []
    with pytest.raises(ValueError, match="last prompt token"):
        mgr.allocate(1, tokens, 0, mgr.find_cached_prefix(tokens + [8, 9]))


def test_extra_key_and_chain_separate_prefixes():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    assert mgr.allocate(0, tokens, 5)
    mgr.cache_full_blocks(0, tokens, 5, extra_key="fp8")
    assert mgr.find_cached_prefix(tokens) == []
    assert len(mgr.find_cached_prefix(tokens, extra_key="fp8")) == 2
    assert mgr.find_cached_prefix([9, 9, 3, 4, 5], extra_key="fp8") == []  # same block, other parent


def test_cache_full_blocks_is_incremental():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3]
    assert mgr.allocate(0, tokens, 3)
    mgr.cache_full_blocks(0, tokens, 1)
    assert mgr.pool.num_cached == 0
    mgr.cache_full_blocks(0, tokens, 3)
    assert mgr.pool.num_cached == 1
    append(mgr, 0, tokens, 4)
    assert mgr.pool.num_cached == 2
    with pytest.raises(ValueError):
        mgr.cache_full_blocks(0, tokens, 5)


def test_lru_eviction_oldest_freed_first_recent_hit_survives():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    prompts = {seq: [seq, seq, 0] for seq in range(3)}
    for seq, tokens in prompts.items():
        assert mgr.allocate(seq, tokens, 2)
        mgr.cache_full_blocks(seq, tokens, 2)
    for seq in range(3):
        mgr.free(seq)  # freed in order 0, 1, 2
    assert mgr.num_cached_free_blocks == 3
    assert len(prefill(mgr, 10, prompts[1])) == 1  # hit on seq 1's block; 1 fresh block evicts seq 0's
    assert mgr.find_cached_prefix(prompts[0]) == []
    assert len(mgr.find_cached_prefix(prompts[2])) == 1
    mgr.free(10)
    assert mgr.allocate(11, [7] * 4, 4)  # 2 blocks: evicts seq 2's, then the tail block of seq 10
    assert mgr.find_cached_prefix(prompts[2]) == []
    assert len(mgr.find_cached_prefix(prompts[1])) == 1
    mgr.check_invariants()


def test_free_releases_tail_blocks_first():
    mgr = KVCacheManager(num_blocks=4, block_size=1)
    tokens = [1, 2, 3, 4]
    prefill(mgr, 0, tokens)
    first, second = mgr.block_table(0)[:2]
    mgr.free(0)
    assert mgr.allocate(1, [9], 1) and mgr.allocate(2, [9], 1)
    # Released tail first: blocks 3, 2 were evicted, so the prompt's first two blocks still hit.
    assert [b.block_id for b in mgr.find_cached_prefix(tokens)] == [first, second]


def test_collision_guard_rejects_same_hash_other_tokens():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    victim = mgr.pool.allocate()
    # Forge a collision: block [1, 2] is cached under the hash of block [3, 4].
    assert mgr.pool.cache(victim, hash_block(None, [3, 4]), [1, 2])
    mgr.pool.release(victim)
    assert mgr.find_cached_prefix([3, 4, 5]) == []
    assert mgr.allocate(0, [3, 4, 5], 3)
    assert victim.block_id not in mgr.block_table(0)
    mgr.check_invariants()


def test_copy_on_write_copies_the_shared_partial_block_once_per_writer():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    parent = list(range(6))  # one full block + a partial one
    prefill(mgr, 0, parent)
    full, partial = mgr.block_table(0)
    mgr.fork(0, 1)
    child = list(parent)
    assert mgr.block_table(1) == [full, partial]
    assert mgr.pool.blocks[partial].ref_count == 2 and mgr.take_pending_copies() == []

    assert append(mgr, 0, parent, 100)
    new_parent_block = mgr.block_table(0)[1]
    assert new_parent_block != partial
    assert mgr.take_pending_copies() == [(partial, new_parent_block)]
    assert append(mgr, 1, child, 200)  # the child is now the sole owner: writes in place
    assert mgr.block_table(1) == [full, partial]
    assert mgr.take_pending_copies() == []

    assert append(mgr, 0, parent, 101) and append(mgr, 1, child, 201)  # both fill their block
    assert mgr.take_pending_copies() == []
    assert mgr.pool.blocks[full].ref_count == 2  # full blocks stay shared
    mgr.check_invariants()


def test_copy_on_write_with_three_sharers():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = {0: [1, 2]}
    prefill(mgr, 0, tokens[0])
    for child in (1, 2):
        mgr.fork(0, child)
        tokens[child] = list(tokens[0])
    (shared,) = mgr.block_table(0)
    copies = []
    for seq in (0, 1, 2):
        assert append(mgr, seq, tokens[seq], 10 + seq)
        copies += mgr.take_pending_copies()
    assert [src for src, _ in copies] == [shared, shared]  # the last writer keeps the original
    assert mgr.block_table(2) == [shared]
    mgr.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4]
    prefill(mgr, 0, tokens)
    mgr.fork(0, 1)
    child = list(tokens)
    assert append(mgr, 0, tokens, 5) and append(mgr, 1, child, 6)
    assert mgr.take_pending_copies() == []
    with pytest.raises(ValueError):
        mgr.fork(0, 1)


def test_pending_copy_of_an_aborted_sequence_is_dropped():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [1, 2]
    prefill(mgr, 0, tokens)
    mgr.fork(0, 1)
    assert append(mgr, 1, list(tokens), 3)
    mgr.free(1)
    assert mgr.take_pending_copies() == []
    mgr.check_invariants()

    mgr.fork(0, 2)
    assert mgr.allocate(2, tokens + [3, 4], 2)  # copy-on-write, then the copy fills up
    assert mgr.free_blocks_before(2, 4) == 1  # ... and leaves the window before the forward
    assert mgr.take_pending_copies() == []
    mgr.check_invariants()


def test_allocation_failure_leaves_state_unchanged():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    seq0 = [1, 2, 3, 4, 5]
    prefill(mgr, 0, seq0)  # 3 blocks
    prefill(mgr, 1, [1, 2, 3, 4, 6, 7])  # 2 shared + 1 fresh: the pool is full
    assert mgr.num_free_blocks == 0
    before = snapshot(mgr, [0, 1, 2])
    assert not mgr.allocate(2, [8, 9, 10], 3)
    assert 2 not in mgr
    assert append(mgr, 0, seq0, 6)  # fills seq 0's last block: no new block needed
    before = snapshot(mgr, [0, 1, 2])
    assert not append(mgr, 0, seq0, 7)
    assert snapshot(mgr, [0, 1, 2]) == before and seq0 == [1, 2, 3, 4, 5, 6]
    mgr.fork(0, 3)
    mgr.free(1)  # one free block
    before = snapshot(mgr, [0, 2, 3])
    assert not mgr.allocate(2, [8, 9, 10], 3)
    assert snapshot(mgr, [0, 2, 3]) == before
    mgr.check_invariants()


def test_allocation_failure_counts_revived_prefix_blocks():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    mgr.free(0)
    assert mgr.allocate(1, [9], 1)  # takes the never-used block; 3 free, 2 of them cached
    prompt = [1, 2, 3, 4, 6, 7, 8]
    prefix = mgr.find_cached_prefix(prompt)
    assert len(prefix) == 2 and (mgr.num_free_blocks, mgr.num_cached_free_blocks) == (3, 2)
    before = snapshot(mgr, [1, 2])
    assert not mgr.allocate(2, prompt, 3, prefix)  # 2 revived + 2 fresh > 3 free
    assert snapshot(mgr, [1, 2]) == before
    assert mgr.allocate(2, prompt, 1, prefix)  # 2 revived + 1 fresh
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_free_blocks_before_nulls_entries_and_appends_still_work():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    tokens = list(range(7))
    prefill(mgr, 0, tokens)
    table = mgr.block_table(0)
    assert mgr.free_blocks_before(0, 5) == 2
    assert mgr.block_table(0) == [NULL_BLOCK, NULL_BLOCK] + table[2:]
    assert mgr.free_blocks_before(0, 5) == 0 and mgr.free_blocks_before(0, 1) == 0
    assert mgr.num_used_blocks == 2
    for t in range(7, 10):
        assert append(mgr, 0, tokens, t)
    assert mgr.free_blocks_before(0, 8) == 2
    assert mgr.block_table(0)[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in mgr.block_table(0)[4:]
    with pytest.raises(ValueError):
        mgr.free_blocks_before(0, 11)
    mgr.fork(0, 1)
    mgr.free(0)
    mgr.free(1)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 8


def test_prefix_caching_off():
    mgr = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    assert mgr.find_cached_prefix([1, 2, 3, 4, 5]) == []
    mgr.free(0)
    assert mgr.num_cached_free_blocks == 0 and mgr.prefix_queries == 0


def test_misuse_raises():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=8, block_size=3)
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    with pytest.raises(KeyError):
        mgr.block_table(5)
    with pytest.raises(KeyError):
        mgr.free(5)
    tokens = [1, 2, 3]
    prefill(mgr, 0, tokens)
    prefix = mgr.find_cached_prefix(tokens)
    with pytest.raises(ValueError, match="first allocate"):
        mgr.allocate(0, tokens, 0, prefix)
    with pytest.raises(ValueError, match="only 3 tokens"):
        mgr.allocate(0, tokens, 1)
    with pytest.raises(ValueError, match="does not match"):
        mgr.allocate(1, [5, 6, 7], 1, prefix)
    with pytest.raises(ValueError):
        mgr.allocate(1, tokens, -1)


# -- stateful model check ----------------------------------------------------------------------


@dataclass
class SeqModel:
    tokens: list[int]
    computed: int = 0  # tokens whose K/V the fake runner has written
    scheduled: int = 0  # slots allocated for the next forward
    window_blocks: int = 0  # leading blocks dropped by free_blocks_before


TOKENS = st.integers(0, 2)  # a tiny vocabulary, so prompts share prefixes


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler + runner would, with a fake KV tensor.

    The fake tensor maps a slot to the context its K/V was computed from (`tokens[:t + 1]`), so a
    wrong prefix hit, a missing copy-on-write or a write into a shared block shows up as a slot
    whose context differs from the sequence's. Rules with nothing to act on do nothing (rather
    than using preconditions, which make hypothesis discard many runs).
    """

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, SeqModel] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([2, 4, 1]),
                prefix_caching=st.booleans(),
                prompts=st.lists(st.lists(TOKENS, min_size=2, max_size=12), min_size=1, max_size=3))
    def setup(self, num_blocks, block_size, prefix_caching, prompts):
        self.mgr = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.prompts = prompts

    # -- helpers --

    def pick(self, data, unscheduled_only: bool = False) -> int | None:
        ids = sorted(s for s, m in self.seqs.items() if not (unscheduled_only and m.scheduled))
        return data.draw(st.sampled_from(ids)) if ids else None

    def slot(self, seq_id: int, t: int) -> int:
        bs = self.mgr.block_size
        block = self.mgr.block_table(seq_id)[t // bs]
        assert block != NULL_BLOCK
        return block * bs + t % bs

    def try_allocate(self, seq_id, tokens, num_new, prefix=None, num_lookahead=0) -> bool:
        before = snapshot(self.mgr, self.seqs)
        ok = self.mgr.allocate(seq_id, tokens, num_new, prefix, num_lookahead=num_lookahead)
        if not ok:
            event("allocation failed")
            assert snapshot(self.mgr, self.seqs) == before
            assert seq_id in self.seqs or seq_id not in self.mgr
        return ok

    # -- rules --

    @rule(data=st.data(), use_prefix=st.sampled_from([True, True, False]), chunk=st.integers(1, 12),
          run=st.booleans())
    def add_sequence(self, data, use_prefix, chunk, run):
        """A new prompt (often sharing a prefix), first chunk scheduled; `run`: forward right away."""
        tokens = data.draw(st.sampled_from(self.prompts)) + data.draw(st.lists(TOKENS, max_size=4))
        bs = self.mgr.block_size
        prefix = self.mgr.find_cached_prefix(tokens) if use_prefix else None
        for i, block in enumerate(prefix or []):
            assert block.token_ids == tuple(tokens[i * bs:(i + 1) * bs])
        num_cached = len(prefix or []) * bs
        assert num_cached <= len(tokens) - 1
        hits = self.mgr.prefix_hits
        seq_id, self.next_id = self.next_id, self.next_id + 1
        num_new = min(chunk, len(tokens) - num_cached)
        if self.try_allocate(seq_id, tokens, num_new, prefix):
            self.seqs[seq_id] = SeqModel(tokens, computed=num_cached, scheduled=num_new)
            assert self.mgr.prefix_hits == hits + (num_cached if self.mgr.enable_prefix_caching else 0)
            if num_cached:
                event("prefix hit")
        if run:
            self.forward()

    @rule(data=st.data(), token=TOKENS, chunk=st.integers(1, 6), run=st.booleans())
    def schedule(self, data, token, chunk, run):
        """Next prefill chunk, or one decode token once the prompt is computed."""
        seq_id = self.pick(data, unscheduled_only=True)
        if seq_id is not None:
            self.schedule_seq(seq_id, token, chunk)
        if run:
            self.forward()

    def schedule_seq(self, seq_id: int, token: int, chunk: int) -> None:
        seq = self.seqs[seq_id]
        decode = seq.computed == len(seq.tokens)
        if decode:
            seq.tokens.append(token)
        num_new = min(chunk, len(seq.tokens) - seq.computed)
        if self.try_allocate(seq_id, seq.tokens, num_new):
            seq.scheduled = num_new
        elif decode:
            seq.tokens.pop()

    @rule()
    def forward(self):
        """The fake runner: copy-on-write copies, then writes, then registers full blocks."""
        bs = self.mgr.block_size
        copies = self.mgr.take_pending_copies()
        if copies:
            event("copy-on-write")
        rows = {(dst, i): self.kv.get(src * bs + i) for src, dst in copies for i in range(bs)}
        for (dst, i), context in rows.items():
            self.kv[dst * bs + i] = context
        for seq_id, seq in self.seqs.items():
            for t in range(seq.computed, seq.computed + seq.scheduled):
                slot = self.slot(seq_id, t)
                assert self.mgr.pool.blocks[slot // bs].ref_count == 1, "write into a shared block"
                self.kv[slot] = tuple(seq.tokens[:t + 1])
            seq.computed += seq.scheduled
            seq.scheduled = 0
            self.mgr.cache_full_blocks(seq_id, seq.tokens, seq.computed)

    @rule(data=st.data(), token=TOKENS, draft=st.lists(TOKENS, min_size=1, max_size=6), bonus=TOKENS)
    def speculate(self, data, token, draft, bonus):
        """A speculative decode: the new token and a draft get slots and K/V; `m` drafts are accepted,
        the rest taken back (truncate), then the target's own next token is appended."""
        seq_id = self.pick(data, unscheduled_only=True)
        if seq_id is None or self.seqs[seq_id].computed != len(self.seqs[seq_id].tokens):
            return
        seq = self.seqs[seq_id]
        seq.tokens.append(token)
        if not self.try_allocate(seq_id, seq.tokens, 1 + len(draft), num_lookahead=len(draft)):
            seq.tokens.pop()
            return
        self.forward()  # computes nothing for seq: its table is written here, the drafts included
        proposed = seq.tokens + draft
        for t in range(seq.computed, seq.computed + 1 + len(draft)):
            slot = self.slot(seq_id, t)
            assert self.mgr.pool.blocks[slot // self.mgr.block_size].ref_count == 1, "write into a shared block"
            self.kv[slot] = tuple(proposed[:t + 1])
        accepted = data.draw(st.integers(0, len(draft)))
        seq.tokens += draft[:accepted]
        seq.computed = len(seq.tokens)
        freed = self.mgr.truncate(seq_id, seq.computed)
        if freed:
            event("truncate freed blocks")
        self.mgr.cache_full_blocks(seq_id, seq.tokens, seq.computed)
        seq.tokens.append(bonus)  # sampled, not yet computed: the next schedule computes it

    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=2, max_size=2), step=st.booleans())
    def fork(self, data, tokens, step):
        """Parallel sampling: a child shares the parent's blocks; `step`: both decode a token."""
        parent_id = self.pick(data, unscheduled_only=True)
        if parent_id is None:
            return
        parent, child_id = self.seqs[parent_id], self.next_id
        self.mgr.fork(parent_id, child_id)
        self.seqs[child_id] = SeqModel(list(parent.tokens), parent.computed, 0, parent.window_blocks)
        self.next_id += 1
        if step:
            for seq_id, token in zip((parent_id, child_id), tokens):
                self.schedule_seq(seq_id, token, chunk=1)
            self.forward()

    @rule(data=st.data(), everyone=st.sampled_from([False] * 5 + [True]))
    def free(self, data, everyone):
        """Finish, abort (possibly with tokens scheduled) or preemption; sometimes of everyone."""
        if everyone:
            self.free_all()
            return
        seq_id = self.pick(data)
        if seq_id is not None:
            self.mgr.free(seq_id)
            del self.seqs[seq_id]

    @rule(data=st.data())
    def slide_window(self, data):
        seq_id = self.pick(data)
        if seq_id is None:
            return
        seq = self.seqs[seq_id]
        num_tokens = data.draw(st.integers(0, seq.computed))
        new_window = max(seq.window_blocks, num_tokens // self.mgr.block_size)
        assert self.mgr.free_blocks_before(seq_id, num_tokens) == new_window - seq.window_blocks
        if new_window > seq.window_blocks:
            event("window freed blocks")
        seq.window_blocks = new_window

    def free_all(self):
        for seq_id in list(self.seqs):
            self.mgr.free(seq_id)
        self.seqs.clear()
        self.check_idle()

    # -- checks --

    @invariant()
    def invariants_hold(self):
        self.mgr.check_invariants()
        bs = self.mgr.block_size
        for seq_id, seq in self.seqs.items():
            table = self.mgr.block_table(seq_id)
            assert self.mgr.num_slots(seq_id) == seq.computed + seq.scheduled <= len(seq.tokens)
            assert len(table) == -(-(seq.computed + seq.scheduled) // bs)
            assert table[:seq.window_blocks] == [NULL_BLOCK] * seq.window_blocks
            if seq.scheduled == 0:  # its pending copies (if any) are done: the contents must match
                for t in range(seq.window_blocks * bs, seq.computed):
                    assert self.kv.get(self.slot(seq_id, t)) == tuple(seq.tokens[:t + 1])

    def check_idle(self):
        """No live sequence: every block is free (cached-evictable included), every ref_count 0."""
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks and self.mgr.num_used_blocks == 0
        assert self.mgr.num_cached_free_blocks == self.mgr.pool.num_cached
        assert all(b.ref_count == 0 for b in self.mgr.pool.blocks)
        assert self.mgr.take_pending_copies() == []

    def teardown(self):
        if hasattr(self, "mgr"):
            self.free_all()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# -- speculative decoding: lookahead slots and truncate ------------------------------------------


def test_lookahead_slots_past_the_tokens_and_truncate_gives_the_rejected_ones_back():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(6))
    prefill(mgr, 0, tokens[:5])
    tokens = tokens[:6]  # a decode: token 5 plus 7 speculative ones, slots 5..12 (blocks 1..3)
    with pytest.raises(ValueError, match="only 6 tokens"):
        mgr.allocate(0, tokens, 8)
    assert mgr.allocate(0, tokens, 8, num_lookahead=7)
    assert mgr.num_slots(0) == 13 and mgr.num_live_blocks(0) == 4
    free_before = mgr.num_free_blocks
    assert mgr.truncate(0, 7) == 2  # two drafts accepted: tokens 0..6 computed, blocks 2 and 3 go back
    assert mgr.num_slots(0) == 7 and mgr.block_table(0)[:2] == mgr.block_table(0) and len(mgr.block_table(0)) == 2
    assert mgr.num_free_blocks == free_before + 2
    mgr.check_invariants()
    assert mgr.allocate(0, tokens + [6, 7], 1)  # the next decode extends from the new end
    assert mgr.num_slots(0) == 8
    mgr.free(0)
    mgr.check_invariants()


def test_truncate_never_cuts_hashed_blocks_and_rejected_tokens_are_never_cached():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    prefill(mgr, 0, tokens)  # blocks 0 and 1 full and hashed
    assert mgr.allocate(0, tokens + [9], 4, num_lookahead=3)  # token 9 + drafts at slots 10..12
    with pytest.raises(ValueError, match="cannot truncate"):
        mgr.truncate(0, 7)
    mgr.truncate(0, 10)  # every draft rejected
    mgr.cache_full_blocks(0, tokens + [9], 10)
    assert mgr.pool.num_cached_free == 0 and len(mgr.pool.hashed_block_ids()) == 2
    mgr.free(0)
    mgr.check_invariants()
    assert len(mgr.find_cached_prefix(tokens + [9, 10, 11, 12])) == 2  # only the verified blocks
