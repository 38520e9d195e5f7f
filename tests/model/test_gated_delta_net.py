"""kvgen.model.gated_delta_net: the chunked and recurrent forms of the gated delta rule agree with each
other and with transformers' torch references (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule) within a bound derived below, a prefill split anywhere continues from
its carried state, and the convolution, gates and gated norm are transformers' ops.

The bound (`rule_bound`). Both forms evaluate the same map in fp32, in different orders. One token maps
each column of the state through S -> exp(g) (I - beta k k^T) S + beta k v^T (k unit-norm, 0 < beta < 1,
g <= 0), a map whose linear part has 2-norm <= 1: an error made at one token is never amplified by the
later ones, so errors add up over the T tokens. At each token a form computes dot products of at most
n = Dk + C terms (Dk in k^T S and S^T q; the chunked form adds sums over up to C positions of a chunk),
and the sum of a dot product's terms' magnitudes is at most sqrt(Dk) * max|S| + max|v| (k and q have
norm <= 1). The chunked form also solves a unit lower-triangular system per chunk, whose rounding its
inverse amplifies by at most kappa = max over chunks of ||(I + A)^-1||_inf (computed from the inputs).
Two forms err, each within that. The worst case (every rounding at its maximum, all of one sign) is

    2 * T * n * eps * (sqrt(Dk) max|S| + max|v|) * kappa,                    eps = 2^-24,

printed beside the measured error; it grows to ~0.1 at 700 tokens, too loose to catch much. The test
asserts the probabilistic form instead (Higham & Mary 2019: roundings of independent sign make a sum of
m of them exceed lambda * sqrt(m) * eps with probability <= 2 exp(-lambda^2 / 2); lambda = 6, 3e-8):

    2 * lambda * sqrt(T * n) * eps * (sqrt(Dk) max|S| + max|v|) * kappa,

max|S| and max|v| read off the run (or the worst case, where that is smaller: a few tokens).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kvgen.model.gated_delta_net import (causal_conv1d, conv1d_step, delta_rule_chunked, delta_rule_recurrent,
                                         delta_rule_step, expand_key_heads, gated_rms_norm, gates, l2_normalize)

EPS32 = 2.0**-24
CHUNK = 64
LENGTHS = [1, 3, 63, 65, 200, 700]


def rule_inputs(T, k_heads=2, v_heads=4, k_dim=16, v_dim=8, seed=0):
    """Random q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] as a layer makes them (g from the same
    formula and ranges: A in (0.01, 16), a, dt_bias ~ N(0, 1)), and an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, k_heads, k_dim, generator=gen), torch.randn(T, k_heads, k_dim, generator=gen)
    v = torch.randn(T, v_heads, v_dim, generator=gen)
    a, b = torch.randn(T, v_heads, generator=gen), torch.randn(T, v_heads, generator=gen)
    A_log = torch.empty(v_heads).uniform_(0.01, 16, generator=gen).log()
    g, beta = gates(a, b, torch.randn(v_heads, generator=gen), A_log=A_log)
    state = torch.randn(v_heads, k_dim, v_dim, generator=gen) * 0.5
    return q, k, v, g, beta, state


def solve_amplification(k, g, beta, v_heads, chunk=CHUNK):
    """kappa: the largest ||(I + A)^-1||_inf over the chunks' triangular systems (see the module docstring)."""
    kf = expand_key_heads(l2_normalize(k.float()), v_heads).transpose(0, 1)
    worst = 1.0
    for start in range(0, k.shape[0], chunk):
        kc, gc, bc = kf[:, start:start + chunk], g[start:start + chunk].t(), beta[start:start + chunk].t()
        gamma = gc.cumsum(-1)
        decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~torch.ones(gamma.shape[1], gamma.shape[1],
                                                                                dtype=torch.bool).tril(), -math.inf).exp()
        system = ((kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]).tril(-1) + torch.eye(kc.shape[1])
        inverse = torch.linalg.inv(system.double())
        worst = max(worst, float(inverse.abs().sum(-1).max()))
    return worst


LAMBDA = 6.0


def rule_bound(T, k_dim, v, states, kappa, chunk=CHUNK, worst_case=False):
    n = k_dim + min(chunk, T)
    scale = math.sqrt(k_dim) * float(states.abs().max()) + float(v.abs().max())
    worst = 2 * T * n * EPS32 * scale * kappa
    return worst if worst_case else min(worst, 2 * LAMBDA * math.sqrt(T * n) * EPS32 * scale * kappa)


def hf_rules():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("T", LENGTHS)
def test_chunked_equals_recurrent_and_transformers(T):
    q, k, v, g, beta, state = rule_inputs(T)
    out_r, states_r = delta_rule_recurrent(q, k, v, g, beta, state, keep_states=True)
    out_c, final_c = delta_rule_chunked(q, k, v, g, beta, state)
    bound_args = (T, k.shape[2], v, torch.cat([state[None], states_r]), solve_amplification(k, g, beta, 4))
    bound, worst = rule_bound(*bound_args), rule_bound(*bound_args, worst_case=True)
    err_out, err_state = float((out_c - out_r).abs().max()), float((final_c - states_r[-1]).abs().max())
    print(f"\nT={T}: chunked vs recurrent: out {err_out:.2e}, state {err_state:.2e}, bound {bound:.2e} "
          f"(worst case {worst:.2e})")
    assert err_out <= bound and err_state <= bound

    hf_chunk, hf_recurrent = hf_rules()
    kwargs = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_r, ref_r_state = hf_recurrent(q[None], k[None], v[None], g[None], beta[None], **kwargs)
    ref_c, ref_c_state = hf_chunk(q[None], k[None], v[None], g[None], beta[None], chunk_size=CHUNK, **kwargs)
    errors = [float((out_r - ref_r[0]).abs().max()), float((states_r[-1] - ref_r_state[0]).abs().max()),
              float((out_c - ref_c[0]).abs().max()), float((final_c - ref_c_state[0]).abs().max())]
    print(f"  against transformers (recurrent out, state, chunked out, state): {[f'{e:.2e}' for e in errors]}")
    assert max(errors) <= bound


@pytest.mark.parametrize(("T", "split"), [(3, 1), (63, 62), (65, 1), (200, 37), (700, 300), (700, 64)])
def test_prefill_in_two_ragged_chunks_continues_from_the_state(T, split):
    """Chunked prefill: the second piece starts from the first's final state, mid-chunk of the 64-token
    tiling or not, and gives one pass's outputs and state."""
    q, k, v, g, beta, state = rule_inputs(T, seed=1)
    whole, whole_state = delta_rule_chunked(q, k, v, g, beta, state)
    first, mid = delta_rule_chunked(q[:split], k[:split], v[:split], g[:split], beta[:split], state)
    second, end = delta_rule_chunked(q[split:], k[split:], v[split:], g[split:], beta[split:], mid)
    _, states = delta_rule_recurrent(q, k, v, g, beta, state, keep_states=True)
    bound = rule_bound(T, k.shape[2], v, states, solve_amplification(k, g, beta, 4))
    err = max(float((torch.cat([first, second]) - whole).abs().max()), float((end - whole_state).abs().max()))
    print(f"\nT={T} split at {split}: {err:.2e} (bound {bound:.2e})")
    assert err <= bound
    # and a prefill continued by decode steps (the recurrent form) from the carried state
    tail, tail_state = delta_rule_recurrent(q[split:], k[split:], v[split:], g[split:], beta[split:], mid)
    assert float((tail - whole[split:]).abs().max()) <= bound and float((tail_state - whole_state).abs().max()) <= bound


def test_step_batches_sequences_and_updates_their_states_in_place():
    """delta_rule_step over B sequences (a decode batch) is each sequence's recurrent step."""
    B = 5
    inputs = [rule_inputs(1, seed=10 + i) for i in range(B)]
    q, k, v, g, beta, states = (torch.cat([x[j] for x in inputs]) if j < 5 else torch.stack([x[5] for x in inputs])
                                for j in range(6))
    pool = states.clone()
    out = delta_rule_step(q, k, v, g, beta, pool)
    for i, (qi, ki, vi, gi, bi, si) in enumerate(inputs):
        ref, ref_state = delta_rule_recurrent(qi, ki, vi, gi, bi, si)
        assert torch.equal(out[i], ref[0]) and torch.equal(pool[i], ref_state)


def test_keep_states_are_the_states_after_each_position():
    q, k, v, g, beta, state = rule_inputs(9, seed=2)
    _, states = delta_rule_recurrent(q, k, v, g, beta, state, keep_states=True)
    for n in (1, 4, 9):
        _, prefix_state = delta_rule_recurrent(q[:n], k[:n], v[:n], g[:n], beta[:n], state)
        assert torch.equal(states[n - 1], prefix_state)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_tiled_value_heads_are_the_grouped_ones_reordered(form):
    """A GGUF's value heads come tiled (value head h reads key head h mod Hk): the same layer with its
    value heads permuted gives the permuted outputs and state."""
    k_heads, v_heads = 2, 6
    q, k, v, g, beta, state = rule_inputs(70, k_heads=k_heads, v_heads=v_heads, seed=3)
    r = v_heads // k_heads
    tiled_from_grouped = torch.arange(v_heads).reshape(k_heads, r).t().reshape(-1)  # tiled head h = grouped head [h]
    rule = delta_rule_recurrent if form == "recurrent" else delta_rule_chunked
    out, final = rule(q, k, v, g, beta, state)
    p = tiled_from_grouped
    out_t, final_t = rule(q, k, v[:, p], g[:, p], beta[:, p], state[p], v_head_order="tiled")
    assert torch.allclose(out_t, out[:, p], rtol=0, atol=1e-5) and torch.allclose(final_t, final[p], rtol=0, atol=1e-5)


def test_gates_are_transformers_formula_from_either_checkpoint_form():
    gen = torch.Generator().manual_seed(4)
    a, b, dt_bias = torch.randn(7, 4, generator=gen), torch.randn(7, 4, generator=gen), torch.randn(4, generator=gen)
    A_log = torch.empty(4).uniform_(0.01, 16, generator=gen).log()
    g, beta = gates(a, b, dt_bias, A_log=A_log)
    assert torch.equal(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias))
    assert torch.equal(beta, b.sigmoid())
    g_gguf, _ = gates(a, b, dt_bias, decay_rate=-torch.exp(A_log))  # the GGUF's ssm_a
    assert torch.equal(g_gguf, g)
    with pytest.raises(ValueError):
        gates(a, b, dt_bias)


@pytest.mark.parametrize("T", [1, 3, 65])
def test_conv_matches_transformers_and_carries_its_window(T):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    gen = torch.Generator().manual_seed(5)
    channels, kernel = 24, 4
    x, weight = torch.randn(T + 5, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    ref = causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    y, window = causal_conv1d(x, weight)
    tol = kernel * EPS32 * float((x.abs().max() * weight.abs().sum(-1)).max()) * 2  # K-term sums, silu' <= 1.1
    assert float((y - ref).abs().max()) <= tol and torch.equal(window, x[-(kernel - 1):].t())
    # the same tokens in two pieces, then one step at a time
    y1, w1 = causal_conv1d(x[:T], weight)
    y2, w2 = causal_conv1d(x[T:], weight, w1)
    assert float((torch.cat([y1, y2]) - ref).abs().max()) <= tol and torch.equal(w2, window)
    windows = torch.zeros(1, channels, kernel - 1)
    steps = torch.cat([conv1d_step(x[t:t + 1], weight, windows) for t in range(x.shape[0])])
    assert float((steps - ref).abs().max()) <= tol and torch.equal(windows[0], window)


def test_gated_norm_is_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    gen = torch.Generator().manual_seed(6)
    o, z = torch.randn(10, 4, 16, generator=gen), torch.randn(10, 4, 16, generator=gen)
    norm = Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen))
        ref = norm(o, z)
    assert torch.equal(gated_rms_norm(o, z, norm.weight.detach(), 1e-6), ref)
    o16, z16 = o.bfloat16(), z.bfloat16()
    with torch.no_grad():
        ref16 = norm.to(torch.bfloat16)(o16, z16)
    assert torch.equal(gated_rms_norm(o16, z16, norm.weight.detach(), 1e-6), ref16)


def test_shapes_are_checked():
    q, k, v, g, beta, state = rule_inputs(4)
    with pytest.raises(ValueError, match="delta rule"):
        delta_rule_chunked(q, k, v, g[:, :2], beta, state)
    with pytest.raises(ValueError, match="evenly"):
        expand_key_heads(torch.zeros(3, 3, 8), 4)
