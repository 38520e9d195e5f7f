"""kvgen.model.delta_net_layer against transformers' Qwen3_5GatedDeltaNet (fp32, random weights): a prompt
in one chunk, in ragged chunks, several sequences' chunks in one batch over a state pool, continued by
decode steps over the pool, and a verify chunk whose per-position states are what decoding those tokens
gives; each in torch and with the C kernel.

Bound (`output_bound`): the layer output is out_proj(w * norm(o) * silu(z)). o differs from transformers'
by the delta rule's difference between two fp32 forms: derived and asserted in
tests/model/test_gated_delta_net.py and test_gated_delta_net_prefill.py, where it measures <= 1e-6 at
these sizes and lengths (E_O; the derived bound itself, ~1e-3 there, would be too loose once amplified
below). The norm maps an error E_O in o to at most E_O (1 + sqrt(Dv)) / rms(o) per element (to first
order: d(o_j / rms) has the direct term E_O / rms and the rms term |o_j| E_O / rms^2, |o_j| <= sqrt(Dv)
rms), token by token, scaled by |w silu(z)|, and out_proj sums those through |W|; the norm's and
out_proj's own roundings add 2 (Hv Dv + 2 Dv) eps |W| |w norm(o) silu(z)|. A token whose o is small
(rms ~1e-3) gets a wide bound, most ~2e-3 (errors measure up to half of it); a real mistake (a wrong
head order or gate) moves outputs by ~0.1.
"""

import pytest
import torch

from kvgen.cache.state_pool import StatePool
from kvgen.config import RecurrentShape
from kvgen.model.delta_net_layer import DeltaNetLayer, decode, prefill, prefill_ragged, verify
import torch.nn.functional as F

from kvgen.model.gated_delta_net import causal_conv1d, delta_rule_recurrent, gates
from kvgen.model.kernels.gated_delta_net import gated_delta_net_kernel
from tests.model.test_gated_delta_net import EPS32, rule_bound, solve_amplification

E_O = 1e-6  # the rule's difference between two fp32 forms here (module docstring)

SHAPE = RecurrentShape(k_heads=2, v_heads=4, k_dim=16, v_dim=8, conv_kernel=4)


@pytest.fixture(scope="module")
def hf_layer():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               linear_num_key_heads=SHAPE.k_heads, linear_num_value_heads=SHAPE.v_heads,
                               linear_key_head_dim=SHAPE.k_dim, linear_value_head_dim=SHAPE.v_dim,
                               layer_types=["linear_attention"])
    layer = Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.empty(SHAPE.v_heads).uniform_(0.01, 16).log())
    return layer


def ours(hf) -> DeltaNetLayer:
    return DeltaNetLayer.from_hf(SHAPE, hf.conv1d.weight.detach(), hf.A_log.detach(), hf.dt_bias.detach(),
                                 hf.norm.weight.detach(), hf.layer_norm_epsilon)


def projections(hf, h):
    with torch.no_grad():
        return hf.in_proj_qkv(h), hf.in_proj_z(h), hf.in_proj_a(h), hf.in_proj_b(h)


def reference(hf, h):
    with torch.no_grad():
        return hf(h[None])[0]


def output_bound(hf, h) -> torch.Tensor:
    """The bound on |ours - transformers'| for each output of the text h [T, hidden] (module docstring)."""
    layer, (mixed, z, a, b) = ours(hf), projections(hf, h)
    x, _ = causal_conv1d(mixed, layer.conv_weight)
    q, k, v = layer.split(x)
    g, beta = gates(a, b, layer.dt_bias, decay_rate=layer.decay_rate)
    o, _ = delta_rule_recurrent(q, k, v, g, beta)
    rms = o.pow(2).mean(-1, keepdim=True).sqrt()                                      # [T, Hv, 1]
    gate = (layer.norm_weight * F.silu(z.unflatten(1, o.shape[1:]))).abs()            # [T, Hv, Dv]
    W = hf.out_proj.weight.detach().abs()                                             # [hidden, Hv Dv]
    propagated = (E_O * (1 + SHAPE.v_dim ** 0.5) / rms * gate).flatten(1) @ W.t()        # [T, hidden]
    terms = SHAPE.v_heads * SHAPE.v_dim + 2 * SHAPE.v_dim
    rounding = 2 * terms * EPS32 * (layer._finish(o, z, o.dtype).abs() @ W.t())
    return propagated + rounding


def assert_close(got, want, bound):
    """|got - want| <= bound, element by element (bound [T, hidden]: the rows of got's tokens)."""
    err = (got - want).abs()
    print(f" {float(err.max()):.2e} (median bound {float(bound.median()):.2e}, "
          f"error / bound <= {float((err / bound).max()):.2f})", end="")
    assert bool((err <= bound).all())


def kernel_or_none(use_kernel: bool):
    kernel = gated_delta_net_kernel() if use_kernel else None
    assert kernel is not None or not use_kernel, "the Gated DeltaNet kernel did not build (see the log)"
    return kernel


USE_KERNEL = pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "C"])


@USE_KERNEL
def test_prefill_in_one_and_in_ragged_chunks(hf_layer, use_kernel):
    kernel = kernel_or_none(use_kernel)
    layer, h = ours(hf_layer), torch.randn(150, 32)
    ref, bound = reference(hf_layer, h), output_bound(hf_layer, h)
    mixed, z, a, b = projections(hf_layer, h)
    y, _, _ = prefill(layer, mixed, z, a, b, kernel=kernel)
    with torch.no_grad():
        assert_close(hf_layer.out_proj(y), ref, bound)
    window = state = None
    pieces = []
    for lo, hi in ((0, 7), (7, 71), (71, 150)):
        y, window, state = prefill(layer, mixed[lo:hi], z[lo:hi], a[lo:hi], b[lo:hi], window, state, kernel=kernel)
        pieces.append(y)
    with torch.no_grad():
        assert_close(hf_layer.out_proj(torch.cat(pieces)), ref, bound)


@USE_KERNEL
def test_ragged_prefill_over_the_state_pool(hf_layer, use_kernel):
    """Four sequences' prompt chunks in one batch, each continuing from its slot (one fresh, three
    prefilled before to different lengths), then a second ragged batch: each gives transformers' output."""
    kernel = kernel_or_none(use_kernel)
    layer, pool = ours(hf_layer), StatePool(SHAPE, 1, num_slots=6)
    texts = [torch.randn(n, 32) for n in (5, 80, 140, 30)]
    cuts = [(0, 3, 5), (20, 21, 80), (64, 100, 140), (0, 17, 30)]  # before, after the first batch, the end
    slots = torch.tensor([pool.allocate() for _ in texts]).flip(0)
    conv, states = pool.layer(0)
    for text, (done, _, _), slot in zip(texts, cuts, slots.tolist()):
        if done:
            _, conv[slot], states[slot] = prefill(layer, *projections(hf_layer, text[:done]))
    outs = [[] for _ in texts]
    for lo_of, hi_of in ((0, 1), (1, 2)):
        pieces = [text[cut[lo_of]:cut[hi_of]] for text, cut in zip(texts, cuts)]
        y = prefill_ragged(layer, *projections(hf_layer, torch.cat(pieces)), conv, states, slots,
                           [len(p) for p in pieces], kernel)
        for out, part in zip(outs, y.split([len(p) for p in pieces])):
            out.append(part)
    for text, (done, _, _), out in zip(texts, cuts, outs):
        with torch.no_grad():
            got = hf_layer.out_proj(torch.cat(out))
        assert_close(got, reference(hf_layer, text)[done:], output_bound(hf_layer, text)[done:])


@USE_KERNEL
def test_decode_over_the_state_pool_continues_the_prefill(hf_layer, use_kernel):
    """Three sequences prefilled to different lengths, then decoded together, one token a step, from
    their pool slots: each gives transformers' output for its whole text."""
    kernel = kernel_or_none(use_kernel)
    layer, pool = ours(hf_layer), StatePool(SHAPE, 1, num_slots=5)
    texts = [torch.randn(n, 32) for n in (6, 64, 90)]
    prompt = [n - 6 for n in (6, 64, 90)]  # the first starts from an empty slot
    slots = []
    conv, states = pool.layer(0)
    for text, n in zip(texts, prompt):
        slot = pool.allocate()
        slots.append(slot)
        if n:
            _, conv[slot], states[slot] = prefill(layer, *projections(hf_layer, text[:n]))
    outs = [[] for _ in texts]
    for step in range(6):
        rows = torch.stack([text[n + step] for text, n in zip(texts, prompt)])
        y = decode(layer, *projections(hf_layer, rows), conv, states, torch.tensor(slots), kernel)
        for i in range(len(texts)):
            outs[i].append(y[i])
    for text, n, out in zip(texts, prompt, outs):
        with torch.no_grad():
            got = hf_layer.out_proj(torch.stack(out))
        assert_close(got, reference(hf_layer, text)[n:], output_bound(hf_layer, text)[n:])
    for slot in slots:
        pool.free(slot)
    assert pool.num_used == 0


@USE_KERNEL
def test_verify_keeps_what_decoding_each_token_would_leave(hf_layer, use_kernel):
    layer, h = ours(hf_layer), torch.randn(40, 32)
    mixed, z, a, b = projections(hf_layer, h)
    _, window, state = prefill(layer, mixed[:36], z[:36], a[:36], b[:36])
    y, windows, states = verify(layer, mixed[36:], z[36:], a[36:], b[36:], window, state, kernel_or_none(use_kernel))
    with torch.no_grad():
        assert_close(hf_layer.out_proj(y), reference(hf_layer, h)[36:], output_bound(hf_layer, h)[36:])
    for n in range(1, 5):
        _, w_n, s_n = prefill(layer, mixed[:36 + n], z[:36 + n], a[:36 + n], b[:36 + n])
        assert torch.equal(windows[n - 1], w_n)
        assert float((states[n - 1] - s_n).abs().max()) <= rule_bound_of(layer, mixed[:36 + n], a[:36 + n], b[:36 + n])


def rule_bound_of(layer, mixed, a, b):
    """tests/model/test_gated_delta_net.py's bound between the chunked and recurrent forms, for these inputs."""
    x, _ = causal_conv1d(mixed, layer.conv_weight)
    q, k, v = layer.split(x)
    g, beta = gates(a, b, layer.dt_bias, decay_rate=layer.decay_rate)
    _, states = delta_rule_recurrent(q, k, v, g, beta, keep_states=True)
    return rule_bound(mixed.shape[0], SHAPE.k_dim, v, states, solve_amplification(k, g, beta, SHAPE.v_heads))


def test_tiled_gguf_layout_gives_the_same_layer(hf_layer):
    """The GGUF converter's value-head reordering (tests/loaders/arch_fixtures.py's docstring) applied to
    the weights, read with v_head_order="tiled", gives the same output once out_proj's columns follow."""
    hf = ours(hf_layer)
    r = SHAPE.v_heads // SHAPE.k_heads
    order = torch.arange(SHAPE.v_heads).reshape(SHAPE.k_heads, r).t().reshape(-1)  # tiled head i = grouped order[i]
    kd = 2 * SHAPE.k_heads * SHAPE.k_dim
    channel = torch.cat([torch.arange(kd), kd + (order[:, None] * SHAPE.v_dim + torch.arange(SHAPE.v_dim)).reshape(-1)])
    tiled = DeltaNetLayer(SHAPE, hf.conv_weight[channel], hf.dt_bias[order], hf.decay_rate[order], hf.norm_weight,
                          hf.eps, "tiled")
    h = torch.randn(20, 32)
    mixed, z, a, b = projections(hf_layer, h)
    value_cols = (order[:, None] * SHAPE.v_dim + torch.arange(SHAPE.v_dim)).reshape(-1)
    y, _, _ = prefill(tiled, mixed[:, channel], z[:, value_cols], a[:, order], b[:, order])
    with torch.no_grad():
        got = y @ hf_layer.out_proj.weight[:, value_cols].t()
    assert_close(got, reference(hf_layer, h), output_bound(hf_layer, h))


@USE_KERNEL
def test_verify_from_a_sequences_start(hf_layer, use_kernel):
    layer, h = ours(hf_layer), torch.randn(5, 32)
    y, windows, states = verify(layer, *projections(hf_layer, h), None, None, kernel_or_none(use_kernel))
    with torch.no_grad():
        assert_close(hf_layer.out_proj(y), reference(hf_layer, h), output_bound(hf_layer, h))
    mixed, z, a, b = projections(hf_layer, h)
    _, window, state = prefill(layer, mixed, z, a, b)
    assert torch.equal(windows[-1], window)
    assert float((states[-1] - state).abs().max()) <= rule_bound_of(layer, mixed, a, b)


def test_a_bf16_layer_runs_the_kernel_in_fp32(hf_layer):
    """bf16 rows go through the C forms widened: the fp32 result of the same (bf16-valued) rows rounded
    once, and the same fp32 windows and states, for a prompt chunk and for decode steps after it."""
    kernel, layer = kernel_or_none(True), ours(hf_layer)
    h = torch.randn(24, 32, generator=torch.Generator().manual_seed(5))
    rows = [t.bfloat16() for t in projections(hf_layer, h)]
    wide = [t.float() for t in rows]
    y16, window16, state16 = prefill(layer, *(t[:20] for t in rows), kernel=kernel)
    y32, window32, state32 = prefill(layer, *(t[:20] for t in wide), kernel=kernel)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.bfloat16())
    assert torch.equal(window16, window32) and torch.equal(state16, state32)
    pools16, pools32 = (window16[None].clone(), state16[None].clone()), (window32[None].clone(), state32[None].clone())
    for t in range(20, 24):
        y16 = decode(layer, *(r[t:t + 1] for r in rows), *pools16, torch.tensor([0]), kernel)
        y32 = decode(layer, *(r[t:t + 1] for r in wide), *pools32, torch.tensor([0]), kernel)
        assert torch.equal(y16, y32.bfloat16())
    assert all(torch.equal(p16, p32) for p16, p32 in zip(pools16, pools32))
