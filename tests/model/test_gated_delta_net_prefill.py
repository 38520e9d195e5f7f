"""The C prefill of Gated DeltaNet (kvgen/model/kernels/gated_delta_net.c's gdn_rule and gdn_conv over each
sequence's tokens) against the torch forms: delta_rule_recurrent and delta_rule_chunked, causal_conv1d,
one sequence at a time, for ragged batches of sequences of 1, few (3-17) and many (64-700) tokens, each
starting from its own slot of a pool and leaving its state and window there.

Bounds (tests/model/test_gated_delta_net.py's rule_bound, derived there): the kernel runs the chunked
form with chunks of GROUP (4) tokens (gated_delta_net.c's rule_group; a sequence's last T mod 4 tokens,
and all where the states after each are kept, one at a time), forming o_t from the state before the
chunk's update as decays * q^T S + sum (decays) (q.k_b) u_b: dot products of at most n = Dk + GROUP terms
and a unit triangular system of GROUP rows solved by substitution, within one form's share of
rule_bound(chunk=GROUP, kappa of those systems), against delta_rule_recurrent (n = Dk, kappa 1, the
smaller share). Against delta_rule_chunked (C = 64) that form's share is the larger one: the bound
between the two torch forms covers it. The conv: K-term sums of products, so
2 K eps max|input| max_c sum|w_c| (silu's slope is below 1.1); its windows are copies, compared exactly.
"""

import pytest
import torch

from kvgen.model.gated_delta_net import causal_conv1d, delta_rule_chunked, delta_rule_recurrent, gates
from kvgen.model.kernels.gated_delta_net import GROUP, gated_delta_net_kernel
from tests.model.test_gated_delta_net import EPS32, rule_bound, solve_amplification


@pytest.fixture(scope="module")
def kernel():
    k = gated_delta_net_kernel()
    assert k is not None, "the Gated DeltaNet kernel did not build (see the log)"
    return k


def ragged_inputs(lengths, k_heads, v_heads, k_dim, v_dim, gen):
    """q, k, v as views into one mixed row per token [rows, 2 Hk Dk + Hv Dv] (the conv's output, as a
    layer hands them over), g and beta from Qwen3.5's formula and ranges, and starts [N + 1]."""
    rows = sum(lengths)
    kd = k_heads * k_dim
    mixed = torch.randn(rows, 2 * kd + v_heads * v_dim, generator=gen)
    q, k = mixed[:, :kd].view(rows, k_heads, k_dim), mixed[:, kd:2 * kd].view(rows, k_heads, k_dim)
    v = mixed[:, 2 * kd:].view(rows, v_heads, v_dim)
    A_log = torch.empty(v_heads).uniform_(0.01, 16, generator=gen).log()
    g, beta = gates(torch.randn(rows, v_heads, generator=gen), torch.randn(rows, v_heads, generator=gen),
                    torch.randn(v_heads, generator=gen), A_log=A_log)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, g, beta, starts


CASES = [  # lengths of the sequences of one call, Hk, Hv, Dk, Dv, head order
    ([1], 2, 4, 16, 8, "grouped"),
    ([5], 2, 4, 128, 128, "tiled"),                   # Qwen3.5's head size
    ([700], 2, 4, 16, 8, "grouped"),
    ([3, 64, 1, 17], 2, 6, 32, 48, "tiled"),          # Dv: one block of 32 columns and a part
    ([65, 0, 200, 9], 1, 4, 16, 40, "grouped"),       # a sequence with no tokens in the batch
    ([17, 130, 4], 4, 4, 64, 32, "grouped"),          # no sharing
    ([3, 11], 2, 4, 128, 128, "grouped"),
]


@pytest.mark.parametrize(("lengths", "k_heads", "v_heads", "k_dim", "v_dim", "order"), CASES)
def test_rule_over_ragged_sequences_matches_both_torch_forms(kernel, lengths, k_heads, v_heads, k_dim, v_dim, order):
    gen = torch.Generator().manual_seed(sum(lengths) + v_dim)
    q, k, v, g, beta, starts = ragged_inputs(lengths, k_heads, v_heads, k_dim, v_dim, gen)
    num_slots = len(lengths) + 3
    pool = torch.randn(num_slots, v_heads, k_dim, v_dim, generator=gen) * 0.3
    slots = torch.randperm(num_slots, generator=gen)[:len(lengths)]  # scattered rows of the pool
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    before = pool.clone()
    out, kept = kernel.rule_tokens(q, k, v, g, beta, pool, slots, starts, order)
    assert kept is None and torch.equal(pool[untouched], before[untouched])
    for n, slot in enumerate(slots.tolist()):
        rows = slice(int(starts[n]), int(starts[n + 1]))
        T = rows.stop - rows.start
        if T == 0:
            assert torch.equal(pool[slot], before[slot])
            continue
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot])
        ref_out, states = delta_rule_recurrent(*args, v_head_order=order, keep_states=True)
        chunked_out, chunked_state = delta_rule_chunked(*args, v_head_order=order)
        seen = torch.cat([before[slot][None], states])
        kappa = solve_amplification(k[rows], g[rows], beta[rows], v_heads, chunk=GROUP)
        recurrent_bound = rule_bound(T, k_dim, v[rows], seen, kappa, chunk=GROUP)
        chunked_bound = rule_bound(T, k_dim, v[rows], seen, solve_amplification(k[rows], g[rows], beta[rows], v_heads))
        err_r = max(float((out[rows] - ref_out).abs().max()), float((pool[slot] - states[-1]).abs().max()))
        err_c = max(float((out[rows] - chunked_out).abs().max()), float((pool[slot] - chunked_state).abs().max()))
        print(f"\nT={T} Hk={k_heads} Hv={v_heads} Dk={k_dim} Dv={v_dim} {order}: vs recurrent {err_r:.2e} "
              f"(bound {recurrent_bound:.2e}), vs chunked {err_c:.2e} (bound {chunked_bound:.2e})")
        assert err_r <= recurrent_bound and err_c <= chunked_bound


@pytest.mark.parametrize(("lengths", "v_dim"), [([1], 32), ([4, 9], 40), ([3], 128)])
def test_kept_states_are_the_states_after_each_token(kernel, lengths, v_dim):
    """A verify chunk's checkpoints: the state after every row, as delta_rule_recurrent's keep_states."""
    gen = torch.Generator().manual_seed(len(lengths) * v_dim)
    q, k, v, g, beta, starts = ragged_inputs(lengths, 2, 4, 64, v_dim, gen)
    pool = torch.randn(len(lengths), 4, 64, v_dim, generator=gen) * 0.3
    before = pool.clone()
    out, kept = kernel.rule_tokens(q, k, v, g, beta, pool, torch.arange(len(lengths)), starts, keep_states=True)
    for n in range(len(lengths)):
        rows = slice(int(starts[n]), int(starts[n + 1]))
        _, states = delta_rule_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], before[n], keep_states=True)
        bound = rule_bound(rows.stop - rows.start, 64, v[rows], torch.cat([before[n][None], states]), 1.0, chunk=0)
        assert float((kept[rows] - states).abs().max()) <= bound
        assert torch.equal(kept[rows.stop - 1], pool[n])  # the last checkpoint is the state left in the slot


@pytest.mark.parametrize("lengths", [[1], [2, 1, 3], [17, 0, 64], [700]])
def test_conv_over_ragged_sequences_matches_causal_conv1d(kernel, lengths):
    """Windows continue from each slot and end as each sequence's last K - 1 inputs (from the old window
    where a sequence has fewer tokens); channels cross the kernel's 256-channel tasks."""
    gen = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    channels, width = 300, 4
    weight = torch.randn(channels, width, generator=gen)
    x = torch.randn(sum(lengths), channels + 5, generator=gen)[:, :channels]  # rows strided, columns contiguous
    pool = torch.randn(len(lengths) + 2, channels, width - 1, generator=gen)
    slots = torch.randperm(len(lengths) + 2, generator=gen)[:len(lengths)]
    before = pool.clone()
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = kernel.conv_tokens(x, weight, pool, slots, starts)
    for n, slot in enumerate(slots.tolist()):
        rows = slice(int(starts[n]), int(starts[n + 1]))
        if rows.stop == rows.start:  # no tokens: the window stays (causal_conv1d takes none)
            assert torch.equal(pool[slot], before[slot])
            continue
        ref, window = causal_conv1d(x[rows], weight, before[slot])
        tol = 2 * width * EPS32 * float((x.abs().max() + before.abs().max()) * weight.abs().sum(-1).max())
        assert float((out[rows] - ref).abs().max()) <= tol
        assert torch.equal(pool[slot], window)


def test_bad_batches_are_refused(kernel):
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, starts = ragged_inputs([3, 2], 2, 4, 16, 8, gen)
    pool = torch.zeros(3, 4, 16, 8)
    with pytest.raises(ValueError, match="two sequences"):
        kernel.rule_tokens(q, k, v, g, beta, pool, torch.tensor([1, 1]), starts)
    with pytest.raises(ValueError, match="starts"):
        kernel.rule_tokens(q, k, v, g, beta, pool, torch.tensor([0, 1]), torch.tensor([0, 4, 3]))
    with pytest.raises(ValueError, match="starts"):
        kernel.rule_tokens(q, k, v, g, beta, pool, torch.tensor([0, 1]), torch.tensor([0, 3, 6]))
    with pytest.raises(IndexError):
        kernel.rule_tokens(q, k, v, g, beta, pool, torch.tensor([0, 3]), starts)
    with pytest.raises(ValueError, match="kernel sizes"):
        kernel.conv_tokens(torch.zeros(5, 4), torch.zeros(4, 9), torch.zeros(2, 4, 8), torch.tensor([0, 1]), starts)


def test_threads_share_the_tasks_without_changing_a_bit(kernel):
    """Tasks (a sequence's head, a sequence's 256 channels) are whole on one thread, so two threads give
    one thread's results exactly, ragged lengths and a sequence with no tokens included."""
    from tests.support.torch_threads import torch_threads

    gen = torch.Generator().manual_seed(11)
    lengths = [33, 0, 5, 90, 1]
    q, k, v, g, beta, starts = ragged_inputs(lengths, 2, 4, 64, 64, gen)
    mixed, weight = torch.randn(sum(lengths), 600, generator=gen), torch.randn(600, 4, generator=gen)
    pools = (torch.randn(5, 4, 64, 64, generator=gen), torch.randn(5, 600, 3, generator=gen))
    slots = torch.tensor([4, 0, 2, 1, 3])
    results = []
    for threads in (1, 2):
        states, windows = (p.clone() for p in pools)
        with torch_threads(threads):
            out, _ = kernel.rule_tokens(q, k, v, g, beta, states, slots, starts, "tiled")
            x = kernel.conv_tokens(mixed, weight, windows, slots, starts)
        results.append((out, states, x, windows))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize(("lengths", "v_dim"), [([1], 128), ([3, 17, 5], 40), ([64, 700], 128)])
def test_rule_ends_with_the_gated_norm(kernel, lengths, v_dim):
    """With a gate the kernel returns gated_rms_norm(o, z, w, eps) of its own o. Per element, the mean
    of Dv squares (Dv eps relative, each side), the reciprocal square root (2 eps), three products and
    SiLU (exp within an ulp, an add and a divide) differ by at most (Dv + 16) eps |y| between the two."""
    from kvgen.model.gated_delta_net import gated_rms_norm
    from kvgen.model.kernels.gated_delta_net import GatedNorm

    gen = torch.Generator().manual_seed(v_dim + len(lengths))
    q, k, v, g, beta, starts = ragged_inputs(lengths, 2, 4, 32, v_dim, gen)
    pool = torch.randn(len(lengths), 4, 32, v_dim, generator=gen) * 0.3
    slots = torch.arange(len(lengths))
    z = torch.randn(sum(lengths), 4 * v_dim + 3, generator=gen)[:, :4 * v_dim]  # rows strided
    weight = torch.randn(v_dim, generator=gen)
    o, _ = kernel.rule_tokens(q, k, v, g, beta, pool.clone(), slots, starts)
    y, _ = kernel.rule_tokens(q, k, v, g, beta, pool.clone(), slots, starts, gate=GatedNorm(z, weight, 1e-6))
    ref = gated_rms_norm(o, z.unflatten(1, (4, v_dim)), weight, 1e-6)
    assert bool(((y - ref).abs() <= (v_dim + 16) * EPS32 * ref.abs()).all())
