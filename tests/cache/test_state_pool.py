"""kvgen.cache.state_pool: slots go back (counts return to zero), fork copies, prefix snapshots keyed by
block hash are LRU-evicted and restore the state a recomputation would reach, verify checkpoints leave
no trace of rejected drafts; and the pool's regions plug into the Gated DeltaNet math
(kvgen.model.gated_delta_net) as the engine will use them."""

import pytest
import torch

from kvgen.cache.block_pool import hash_block
from kvgen.cache.state_pool import StatePool, StatePoolError
from kvgen.config import RecurrentShape
from kvgen.model.gated_delta_net import causal_conv1d, delta_rule_chunked, delta_rule_recurrent, gates

SHAPE = RecurrentShape(k_heads=2, v_heads=4, k_dim=8, v_dim=8, conv_kernel=4)
LAYERS = 3


def pool(**kwargs) -> StatePool:
    return StatePool(SHAPE, LAYERS, kwargs.pop("num_slots", 4), **kwargs)


def fill(p: StatePool, slot: int, value: float) -> None:
    p.conv[:, slot].fill_(value)
    p.states[:, slot].fill_(value)


def test_slots_always_go_back():
    p = pool()
    slots = [p.allocate() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3] and p.num_used == 4 and p.num_free == 0
    with pytest.raises(StatePoolError, match="all 4 slots"):
        p.allocate()
    for s in slots:
        p.free(s)
    assert p.num_used == 0 and p.num_free == 4
    p.check()
    with pytest.raises(StatePoolError, match="freed twice"):
        p.free(slots[0])


def test_a_new_slot_starts_from_zeros():
    p = pool(num_slots=1)
    s = p.allocate()
    fill(p, s, 3.0)
    p.free(s)
    s = p.allocate()
    assert not p.conv[:, s].any() and not p.states[:, s].any()


def test_fork_copies_every_layer_and_the_copies_are_independent():
    p = pool()
    parent = p.allocate()
    p.conv[:, parent].normal_()
    p.states[:, parent].normal_()
    child = p.fork(parent)
    assert child != parent
    assert torch.equal(p.conv[:, child], p.conv[:, parent]) and torch.equal(p.states[:, child], p.states[:, parent])
    p.states[:, child].add_(1)
    assert not torch.equal(p.states[:, child], p.states[:, parent])
    for s in (parent, child):
        p.free(s)
    assert p.num_used == 0
    p.check()


def test_snapshots_are_keyed_by_block_hash_and_evicted_least_recently_used_first():
    p = pool(num_snapshots=2)
    s = p.allocate()
    hashes = [hash_block(None, [1, 2, 3, 4]), hash_block(None, [5, 6, 7, 8]), hash_block(None, [9, 9, 9, 9])]
    for value, h in zip((1.0, 2.0), hashes):
        fill(p, s, value)
        assert p.save_snapshot(s, h, tokens=16)
    assert p.num_snapshots == 2
    assert p.restore_snapshot(hashes[0], s) == 16 and float(p.states[0, s, 0, 0, 0]) == 1.0  # hashes[0] now recent
    fill(p, s, 3.0)
    p.save_snapshot(s, hashes[2], tokens=32)  # evicts hashes[1], the least recently used
    assert p.has_snapshot(hashes[0]) and not p.has_snapshot(hashes[1]) and p.has_snapshot(hashes[2])
    assert p.snapshot_tokens(hashes[2]) == 32
    with pytest.raises(KeyError):
        p.restore_snapshot(hashes[1], s)
    # the collision guard: a snapshot saved with its block's token ids answers only for those ids
    p.save_snapshot(s, hashes[2], tokens=32, block_tokens=[9, 9, 9, 9])
    assert p.has_snapshot(hashes[2], [9, 9, 9, 9]) and not p.has_snapshot(hashes[2], [9, 9, 9, 8])
    with pytest.raises(KeyError):
        p.restore_snapshot(hashes[2], s, block_tokens=[9, 9, 9, 8])
    assert p.drop_snapshot(hashes[0]) and not p.drop_snapshot(hashes[0])
    p.free(s)
    p.drop_snapshot(hashes[2])
    assert p.num_used == 0 and p.num_snapshots == 0
    p.check()


def test_a_pool_without_snapshot_rows_keeps_none():
    p = pool()
    s = p.allocate()
    assert not p.save_snapshot(s, 123, 16) and not p.has_snapshot(123)
    p.free(s)


def test_verify_accepts_the_state_after_the_accepted_positions_only():
    p = pool(verify_rows=2, verify_positions=3)
    a, b = p.allocate(), p.allocate()
    fill(p, a, 1.0)
    fill(p, b, 2.0)
    rows = p.begin_verify([a, b])
    for layer in range(LAYERS):
        conv, states = p.checkpoints(layer)
        for r in rows:
            for pos in range(3):
                conv[r, pos].fill_(10 * (r + 1) + pos)
                states[r, pos].fill_(10 * (r + 1) + pos)
    with pytest.raises(StatePoolError, match="verify step"):
        p.free(a)
    p.accept(rows[0], 2)  # a keeps the state after its second position
    p.accept(rows[1], 0)  # b rejected everything: unchanged
    assert torch.all(p.states[:, a] == 10 * (rows[0] + 1) + 1) and torch.all(p.conv[:, a] == 10 * (rows[0] + 1) + 1)
    assert torch.all(p.states[:, b] == 2.0) and torch.all(p.conv[:, b] == 2.0)
    with pytest.raises(StatePoolError):
        p.accept(rows[0], 1)
    p.free(a)
    p.free(b)
    assert p.num_used == 0
    p.check()


def test_sizing_from_a_byte_budget():
    per = LAYERS * SHAPE.bytes()
    p = StatePool.for_budget(SHAPE, LAYERS, budget_bytes=10 * per + per // 2, max_num_seqs=4, snapshot_fraction=0.5)
    assert p.num_slots == 4 and p.num_snapshot_rows == 3 and p.bytes_per_sequence == per
    assert p.total_bytes <= 10 * per + per // 2
    p = StatePool.for_budget(SHAPE, LAYERS, budget_bytes=3 * per, max_num_seqs=8)
    assert p.num_slots == 3  # the budget, not max_num_seqs, bounds it
    p = StatePool.for_budget(SHAPE, LAYERS, budget_bytes=8 * per, max_num_seqs=8, verify_positions=3)
    assert p.num_slots == p.verify_rows == 2 and p.total_bytes <= 8 * per
    with pytest.raises(ValueError, match="hold no sequence"):
        StatePool.for_budget(SHAPE, LAYERS, budget_bytes=per - 1, max_num_seqs=1)


# -- with the math, as the engine will run it -----------------------------------------------------

def layer_inputs(T, seed):
    """What one recurrent layer's projections give for T tokens: the mixed q/k/v row before the conv,
    and a, b."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, SHAPE.conv_dim, generator=gen), torch.randn(T, SHAPE.v_heads, generator=gen),
            torch.randn(T, SHAPE.v_heads, generator=gen))


WEIGHTS = torch.Generator().manual_seed(99)
CONV_W = torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=WEIGHTS)
DT_BIAS, A_LOG = torch.randn(SHAPE.v_heads, generator=WEIGHTS), torch.rand(SHAPE.v_heads, generator=WEIGHTS).log()


def run_layer(p: StatePool, layer: int, slot: int, mixed, a, b, keep_states=False):
    """One sequence's tokens through a layer, from and back into its slot (or, keep_states, into
    per-position states without touching the slot)."""
    conv, states = p.layer(layer)
    x, window = causal_conv1d(mixed, CONV_W, conv[slot])
    kd = SHAPE.k_heads * SHAPE.k_dim
    q = x[:, :kd].reshape(-1, SHAPE.k_heads, SHAPE.k_dim)
    k = x[:, kd:2 * kd].reshape(-1, SHAPE.k_heads, SHAPE.k_dim)
    v = x[:, 2 * kd:].reshape(-1, SHAPE.v_heads, SHAPE.v_dim)
    g, beta = gates(a, b, DT_BIAS, A_log=A_LOG)
    if keep_states:
        return delta_rule_recurrent(q, k, v, g, beta, states[slot], keep_states=True), x
    out, final = delta_rule_chunked(q, k, v, g, beta, states[slot])
    conv[slot].copy_(window)
    states[slot].copy_(final)
    return out


def test_prefix_snapshot_restores_what_recomputing_the_prefix_gives():
    """Prompt A is prefilled to its block boundary (32 tokens) and snapshotted under that block's hash;
    prompt B shares those 32 tokens, restores the snapshot and prefills only its own tail: its state
    equals a full recomputation's."""
    p = pool(num_snapshots=4)
    mixed, a, b = layer_inputs(50, seed=1)
    block_hash = hash_block(hash_block(None, list(range(16))), list(range(16, 32)))
    first = p.allocate()
    for layer in range(LAYERS):
        run_layer(p, layer, first, mixed[:32], a[:32], b[:32])
    p.save_snapshot(first, block_hash, tokens=32)
    p.free(first)

    hit, miss = p.allocate(), p.allocate()
    assert p.restore_snapshot(block_hash, hit) == 32
    for layer in range(LAYERS):
        out_hit = run_layer(p, layer, hit, mixed[32:], a[32:], b[32:])
        out_miss = run_layer(p, layer, miss, mixed, a, b)[32:]
        assert torch.allclose(out_hit, out_miss, rtol=0, atol=1e-5)
    assert torch.allclose(p.states[:, hit], p.states[:, miss], rtol=0, atol=1e-5)
    assert torch.equal(p.conv[:, hit], p.conv[:, miss])  # the window is the last 3 inputs: exact
    p.free(hit)
    p.free(miss)
    assert p.num_used == 0
    p.check()


def test_verify_with_checkpoints_equals_running_only_the_accepted_tokens():
    """A verify step of 3 draft tokens writes per-position states; accepting 1 leaves the slot exactly
    where running only that token would, rejected drafts leave no trace."""
    p = pool(verify_rows=1, verify_positions=3)
    mixed, a, b = layer_inputs(13, seed=2)
    seq, ref = p.allocate(), p.allocate()
    for layer in range(LAYERS):
        run_layer(p, layer, seq, mixed[:10], a[:10], b[:10])
        run_layer(p, layer, ref, mixed[:10], a[:10], b[:10])
    [row] = p.begin_verify([seq])
    for layer in range(LAYERS):
        (_, per_position), x = run_layer(p, layer, seq, mixed[10:], a[10:], b[10:], keep_states=True)
        conv_ckpt, state_ckpt = p.checkpoints(layer)
        state_ckpt[row].copy_(per_position)
        window = torch.cat([p.conv[layer, seq], mixed[10:].t()], dim=1)  # the inputs, oldest first
        for pos in range(3):
            conv_ckpt[row, pos].copy_(window[:, pos + 1:pos + 4])
        run_layer(p, layer, ref, mixed[10:11], a[10:11], b[10:11])  # the reference runs the accepted token only
    p.accept(row, 1)
    assert torch.allclose(p.states[:, seq], p.states[:, ref], rtol=0, atol=1e-6)
    assert torch.equal(p.conv[:, seq], p.conv[:, ref])
    p.free(seq)
    p.free(ref)
    assert p.num_used == 0
    p.check()
