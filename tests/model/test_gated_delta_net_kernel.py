"""The C decode step of Gated DeltaNet (kvgen/model/kernels/gated_delta_net.c) against the torch form
(kvgen.model.gated_delta_net.delta_rule_step / conv1d_step), at 1, few and many rows (sequences), over
many steps, reading and writing states in place in a pool at arbitrary slots.

Bound: the same derivation as tests/model/test_gated_delta_net.py's (rule_bound), with n = Dk terms per
dot product (no chunk) and no triangular solve (kappa = 1): the kernel sums in another order and applies
exp(g) to k^T S instead of to S first, one more rounding per product, within the n.
"""

import pytest
import torch

from kvgen.model.gated_delta_net import conv1d_step, delta_rule_step, gates
from kvgen.model.kernels.gated_delta_net import gated_delta_net_kernel
from tests.model.test_gated_delta_net import EPS32, rule_bound


@pytest.fixture(scope="module")
def kernel():
    k = gated_delta_net_kernel()
    assert k is not None, "the Gated DeltaNet kernel did not build (see the log)"
    return k


def step_inputs(B, k_heads, v_heads, dim, gen):
    """q, k, v as views into one mixed row per sequence [B, 2 Hk D + Hv D] (the conv's output), as a
    layer hands them over; g <= 0 and beta in (0, 1)."""
    mixed = torch.randn(B, (2 * k_heads + v_heads) * dim, generator=gen)
    kd = k_heads * dim
    q, k = mixed[:, :kd].view(B, k_heads, dim), mixed[:, kd:2 * kd].view(B, k_heads, dim)
    v = mixed[:, 2 * kd:].view(B, v_heads, dim)
    g = -torch.rand(B, v_heads, generator=gen) * 2
    return q, k, v, g, torch.rand(B, v_heads, generator=gen)


@pytest.mark.parametrize(("B", "k_heads", "v_heads", "dim", "order"), [
    (1, 2, 4, 128, "grouped"), (3, 2, 4, 128, "tiled"), (3, 4, 4, 64, "grouped"), (64, 2, 6, 32, "tiled")])
def test_step_matches_torch_over_many_steps(kernel, B, k_heads, v_heads, dim, order):
    gen = torch.Generator().manual_seed(B * 7 + dim)
    num_slots = B + 5
    pool = torch.randn(num_slots, v_heads, dim, dim, generator=gen) * 0.3
    slots = torch.randperm(num_slots, generator=gen)[:B]  # scattered rows of the pool
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    before = pool[untouched].clone()
    reference = pool[slots].clone()
    steps, worst, seen_max = 40, 0.0, float(reference.abs().max())
    vmax = 0.0
    for _ in range(steps):
        q, k, v, g, beta = step_inputs(B, k_heads, v_heads, dim, gen)
        out = kernel.step(q, k, v, g, beta, pool, slots, v_head_order=order)
        ref = delta_rule_step(q, k, v, g, beta, reference, v_head_order=order)
        worst = max(worst, float((out - ref).abs().max()), float((pool[slots] - reference).abs().max()))
        seen_max, vmax = max(seen_max, float(reference.abs().max())), max(vmax, float(v.abs().max()))
    bound = rule_bound(steps, dim, torch.tensor([vmax]), torch.tensor([seen_max]), 1.0, chunk=0)
    print(f"\nB={B} Hk={k_heads} Hv={v_heads} D={dim} {order}: {worst:.2e} over {steps} steps (bound {bound:.2e})")
    assert worst <= bound
    assert torch.equal(pool[untouched], before)  # other sequences' slots are not touched


@pytest.mark.parametrize("B", [1, 3, 64])
def test_conv_step_matches_torch(kernel, B):
    gen = torch.Generator().manual_seed(B)
    channels, width = 6 * 16 + 5, 4  # not a multiple of the vector width
    weight = torch.randn(channels, width, generator=gen)
    pool = torch.randn(B + 2, channels, width - 1, generator=gen)
    slots = torch.randperm(B + 2, generator=gen)[:B]
    reference = pool[slots].clone()
    for _ in range(6):  # past the window's length: every entry has been shifted out
        x = torch.randn(B, channels * 2, generator=gen)[:, ::2]  # strided rows... of stride 2: refused
        with pytest.raises(ValueError):
            kernel.conv_step(x, weight, pool, slots)
        x = torch.randn(B, channels + 7, generator=gen)[:, :channels]  # rows strided, columns contiguous
        out = kernel.conv_step(x, weight, pool, slots)
        ref = conv1d_step(x, weight, reference)
        tol = 2 * width * EPS32 * float((x.abs().max() + reference.abs().max()) * weight.abs().sum(-1).max())
        assert float((out - ref).abs().max()) <= tol
        assert torch.equal(pool[slots], reference)  # the window shift is exact


def test_nonuniform_kernel_width(kernel):
    gen = torch.Generator().manual_seed(9)
    weight, pool = torch.randn(10, 3, generator=gen), torch.randn(2, 10, 2, generator=gen)
    reference, slots = pool.clone(), torch.tensor([1, 0])
    x = torch.randn(2, 10, generator=gen)
    out, ref = kernel.conv_step(x, weight, pool, slots), conv1d_step(x, weight, reference[slots])
    assert torch.allclose(out, ref, rtol=0, atol=1e-5) and torch.equal(pool[slots], torch.cat(
        [reference[slots][:, :, 1:], x[:, :, None]], dim=2))


def test_gates_match_torch_and_run_from_a_call_list(kernel):
    """g and beta from a and b as columns of one in_proj row (strided rows), past softplus's threshold
    of 20 too, within a few fp32 ulp of torch's; the call writes what the direct call returns."""
    from kvgen.model.kernels.step import step_kernels

    gen = torch.Generator().manual_seed(5)
    rows, heads = 5, 6
    projected = torch.randn(rows, 2 * heads + 3, generator=gen) * 8
    projected[0, :heads] = torch.linspace(15, 30, heads)  # a + dt_bias on both sides of 20
    a, b = projected[:, :heads], projected[:, heads:2 * heads]
    dt_bias, decay_rate = torch.randn(heads, generator=gen), -torch.rand(heads, generator=gen) * 4
    g, beta = kernel.gates(a, b, dt_bias, decay_rate)
    want_g, want_beta = gates(a, b, dt_bias, decay_rate=decay_rate)
    assert torch.allclose(g, want_g, rtol=4 * EPS32, atol=0) and torch.allclose(beta, want_beta, rtol=4 * EPS32, atol=0)
    g_out, beta_out = torch.empty(rows, heads), torch.empty(rows, heads)
    step_kernels().call_list([kernel.gates_call(a, b, dt_bias, decay_rate, g_out, beta_out)])()
    assert torch.equal(g_out, g) and torch.equal(beta_out, beta)
    with pytest.raises(ValueError):
        kernel.gates(a.double(), b, dt_bias, decay_rate)

def test_bad_arguments_are_refused(kernel):
    q, k, v, g, beta = step_inputs(2, 2, 4, 16, torch.Generator().manual_seed(0))
    pool = torch.zeros(2, 4, 16, 16)
    with pytest.raises(IndexError):
        kernel.step(q, k, v, g, beta, pool, torch.tensor([0, 2]))
    with pytest.raises(ValueError):
        kernel.step(q.double(), k, v, g, beta, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        kernel.step(q, k, v, g, beta, pool, torch.tensor([0, 1]), v_head_order="interleaved")


def _best_us(fn, calls=100, repeats=5):
    import time

    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


@pytest.mark.slow
@pytest.mark.parametrize("v_heads", [16, 32])
@pytest.mark.parametrize("B", [1, 8])
def test_step_time_against_torch(kernel, B, v_heads):
    """The measurement behind the kernel: one decode step of a Qwen3.5-0.8B-shaped linear layer (16 key
    heads x 128, 16 or 32 value heads x 128), one thread, best of 5 x 100 calls, ctypes call included."""
    from tests.support.torch_threads import torch_threads

    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = step_inputs(B, 16, v_heads, 128, gen)
    states = torch.zeros(B, v_heads, 128, 128)
    pool, slots = states.clone(), torch.arange(B)
    channels = (32 + v_heads) * 128
    x, weight, windows = torch.randn(B, channels), torch.randn(channels, 4), torch.zeros(B, channels, 3)
    pool_windows = windows.clone()
    with torch_threads(1):
        torch_step = _best_us(lambda: delta_rule_step(q, k, v, g, beta, states))
        c_step = _best_us(lambda: kernel.step(q, k, v, g, beta, pool, slots))
        torch_conv = _best_us(lambda: conv1d_step(x, weight, windows))
        c_conv = _best_us(lambda: kernel.conv_step(x, weight, pool_windows, slots))
    print(f"\nB={B} Hv={v_heads}: delta step torch {torch_step:.0f} us, C {c_step:.0f} us ({torch_step / c_step:.1f}x); "
          f"conv step torch {torch_conv:.0f} us, C {c_conv:.0f} us ({torch_conv / c_conv:.1f}x)")
    assert c_step < torch_step and c_conv < torch_conv


def test_kernel_calls_run_from_a_call_list(kernel):
    """step_call / conv_step_call in a fused step's call list (kvgen.model.kernels.step): two steps run
    from C with new inputs written into the same tensors give what the direct calls give."""
    from kvgen.model.kernels.step import step_kernels

    runner = step_kernels()
    assert runner is not None
    gen = torch.Generator().manual_seed(3)
    B, Hk, Hv, D = 2, 2, 4, 16
    channels = (2 * Hk + Hv) * D
    weight = torch.randn(channels, 4, generator=gen)
    pools = (torch.randn(3, channels, 3, generator=gen), torch.randn(3, Hv, D, D, generator=gen))
    direct = tuple(p.clone() for p in pools)
    slots = torch.tensor([2, 0])
    mixed, conv_out = torch.empty(B, channels), torch.empty(B, channels)
    g, beta, out = torch.empty(B, Hv), torch.empty(B, Hv), torch.empty(B, Hv, D)
    kd = Hk * D
    q, k = conv_out[:, :kd].view(B, Hk, D), conv_out[:, kd:2 * kd].view(B, Hk, D)
    v = conv_out[:, 2 * kd:].view(B, Hv, D)
    calls = runner.call_list([kernel.conv_step_call(mixed, weight, pools[0], slots, conv_out),
                              kernel.step_call(q, k, v, g, beta, pools[1], slots, out)])
    for _ in range(2):
        mixed.copy_(torch.randn(B, channels, generator=gen))
        g.copy_(-torch.rand(B, Hv, generator=gen))
        beta.copy_(torch.rand(B, Hv, generator=gen))
        calls()
        x = kernel.conv_step(mixed, weight, direct[0], slots)
        expected = kernel.step(*(t.view(B, -1, D) for t in (x[:, :kd], x[:, kd:2 * kd], x[:, 2 * kd:])), g, beta,
                               direct[1], slots)
        assert torch.equal(out, expected) and torch.equal(pools[0], direct[0]) and torch.equal(pools[1], direct[1])
