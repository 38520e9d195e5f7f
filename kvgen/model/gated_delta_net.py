"""Gated DeltaNet (Qwen3.5's linear-attention layers): the math, in torch, independent of any model class.

A linear-attention head keeps a fixed-size state S [Dk, Dv] instead of a KV cache. Per token t, with
q_t, k_t L2-normalized per head (q_t also scaled by Dk^-1/2), decay g_t <= 0 and rate beta_t in (0, 1):

    S'   = exp(g_t) * S_{t-1}                      forget a little of everything
    u_t  = beta_t * (v_t - k_t^T S')               the delta rule: write only what S' mispredicts
    S_t  = S' + k_t u_t^T                          [Dk, Dv]
    o_t  = S_t^T q_t                               [Dv]

Two forms compute it:

- `delta_rule_recurrent` runs that loop: decode (one token per sequence, `delta_rule_step` batches
  sequences) and speculative verify (it can keep the state after every position).
- `delta_rule_chunked` (prefill) takes chunks of C tokens (64) at once. Within a chunk, with
  gamma_t = g_1 + ... + g_t (chunk-local) and S_0 the state at the chunk's start,

      S_t = exp(gamma_t) S_0 + sum_{j<=t} exp(gamma_t - gamma_j) k_j u_j^T,

  so the u's solve one unit lower-triangular system per chunk,

      (I + A) U = beta*V - (beta*exp(gamma)*K) S_0,   A_tj = beta_t exp(gamma_t - gamma_j) k_t.k_j (j < t),

  and o_t = exp(gamma_t) S_0^T q_t + sum_{j<=t} exp(gamma_t - gamma_j) (q_t.k_j) u_j: matmuls of C x Dk,
  C x C and Dk x Dv per head instead of C steps of Dk x Dv each. Chunks run in order, each from the
  state the last left, so a prefill split anywhere (chunked prefill's ragged chunks) continues exactly
  from a carried state; the last chunk may be shorter than C (no padding).

Key heads are shared: Hv value heads read Hk = Hv / r key heads. Which value head reads which key head
is `v_head_order`: "grouped" (Hugging Face's checkpoints: value head h reads key head h // r) or "tiled"
(llama.cpp's GGUFs, whose converter reorders the value heads so that value head h reads key head h mod Hk).

Around the rule (`causal_conv1d`, `conv1d_step`, `gated_rms_norm`, `gates`): the fused q/k/v
projection goes through a causal depthwise convolution of kernel K (4) and SiLU, whose last K - 1 inputs
are the layer's conv window (a sequence's other piece of state); the output is normed per value head
and gated, norm(o) * silu(z). All arithmetic is fp32 whatever the inputs' dtype (as transformers does),
results in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

V_HEAD_ORDERS = ("grouped", "tiled")
L2_EPS = 1e-6  # as transformers' (and flash-linear-attention's) l2norm


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x [..., D] / sqrt(sum(x^2) + eps) over the last dimension, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gates(a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor | None = None,
          decay_rate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [..., Hv] (the in_proj_a / in_proj_b outputs), dt_bias [Hv] and either A_log [Hv] (HF) or
    decay_rate = -exp(A_log) [Hv] (the GGUF's ssm_a) -> (g [..., Hv] fp32, the log decay,
    -exp(A_log) * softplus(a + dt_bias); beta [..., Hv] = sigmoid(b), in b's dtype)."""
    if (A_log is None) == (decay_rate is None):
        raise ValueError("gates: give exactly one of A_log and decay_rate")
    rate = -A_log.float().exp() if decay_rate is None else decay_rate.float()
    return rate * F.softplus(a.float() + dt_bias.float()), b.sigmoid()


def expand_key_heads(x: torch.Tensor, v_heads: int, v_head_order: str = "grouped") -> torch.Tensor:
    """x [..., Hk, D] -> [..., Hv, D]: each value head's key (or query) head, as `v_head_order` pairs them."""
    k_heads = x.shape[-2]
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads cannot share {k_heads} key heads evenly")
    if v_head_order not in V_HEAD_ORDERS:
        raise ValueError(f"v_head_order must be one of {V_HEAD_ORDERS}, not {v_head_order!r}")
    r = v_heads // k_heads
    if r == 1:
        return x
    if v_head_order == "grouped":
        return x.repeat_interleave(r, dim=-2)
    return x.repeat(*([1] * (x.dim() - 2)), r, 1)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_head_order: str,
             normalize_qk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk], v [..., Hv, Dv] -> fp32 q (normalized, scaled by Dk^-1/2), k (normalized),
    both expanded to Hv heads, and v."""
    q, k, v = q.float(), k.float(), v.float()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return expand_key_heads(q, v.shape[-2], v_head_order), expand_key_heads(k, v.shape[-2], v_head_order), v


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor | None) -> None:
    T, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[1:]
    if (q.shape != k.shape or v.shape[0] != T or g.shape != (T, v_heads) or beta.shape != (T, v_heads)
            or (state is not None and state.shape != (v_heads, k_dim, v_dim))):
        raise ValueError(f"delta rule: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv]; got "
                         f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta "
                         f"{list(beta.shape)}, state {None if state is None else list(state.shape)}")


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, v_head_order: str = "grouped", normalize_qk: bool = True) -> torch.Tensor:
    """One token of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv]
    fp32 (updated in place: each sequence's row of the state pool, say) -> o [B, Hv, Dv] in v's dtype."""
    if state.dtype != torch.float32:
        raise ValueError(f"delta_rule_step: the state is fp32, not {state.dtype}")
    qf, kf, vf = _prepare(q, k, v, v_head_order, normalize_qk)                   # [B, Hv, D*]
    state.mul_(g.float().exp()[..., None, None])                                 # S' = exp(g) S
    predicted = torch.einsum("bhkv,bhk->bhv", state, kf)                         # k^T S'   [B, Hv, Dv]
    u = (vf - predicted) * beta.float()[..., None]                               # [B, Hv, Dv]
    state.add_(kf[..., :, None] * u[..., None, :])                               # S += k u^T
    return torch.einsum("bhkv,bhk->bhv", state, qf).to(v.dtype)                  # S^T q


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor | None = None, v_head_order: str = "grouped",
                         normalize_qk: bool = True, keep_states: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv]
    (None: zeros; not modified) -> (o [T, Hv, Dv] in v's dtype, the final state [Hv, Dk, Dv] fp32), or
    with keep_states the state after every position, [T, Hv, Dk, Dv] (a verify step's checkpoints:
    accepting n draft tokens keeps states[n - 1])."""
    _check(q, k, v, g, beta, state)
    T, v_heads, v_dim = v.shape
    current = (torch.zeros(1, v_heads, k.shape[2], v_dim, device=v.device) if state is None
               else state.to(torch.float32, copy=True)[None])
    out = torch.empty(T, v_heads, v_dim, dtype=v.dtype, device=v.device)
    kept = torch.empty(T, *current.shape[1:], device=v.device) if keep_states else None
    for t in range(T):
        out[t] = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], current,
                                 v_head_order, normalize_qk)[0]
        if kept is not None:
            kept[t] = current[0]
    return out, (kept if kept is not None else current[0])


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor | None = None, v_head_order: str = "grouped",
                       normalize_qk: bool = True, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as delta_rule_recurrent (without keep_states), C = chunk_size tokens at a time: q, k
    [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] or None -> (o [T, Hv, Dv] in v's
    dtype, final state [Hv, Dk, Dv] fp32)."""
    _check(q, k, v, g, beta, state)
    T, v_heads, v_dim = v.shape
    k_dim = k.shape[2]
    qf, kf, vf = (x.transpose(0, 1).contiguous() for x in _prepare(q, k, v, v_head_order, normalize_qk))  # [Hv, T, D*]
    gf, bf = g.float().t().contiguous(), beta.float().t().contiguous()                       # [Hv, T]
    device = v.device
    S = torch.zeros(v_heads, k_dim, v_dim, device=device) if state is None else state.to(torch.float32, copy=True)
    out = torch.empty(v_heads, T, v_dim, device=device)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        C = end - start
        qc, kc, vc, bc = qf[:, start:end], kf[:, start:end], vf[:, start:end], bf[:, start:end]
        gamma = gf[:, start:end].cumsum(-1)                                   # [Hv, C]
        # decay from j to t (j <= t), zero above the diagonal; masked before exp (gamma_t - gamma_j > 0 there)
        causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
        decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill_(~causal, float("-inf")).exp_()  # [Hv, C, C]
        scores = torch.cat([qc, kc], dim=1) @ kc.transpose(1, 2)              # [Hv, 2C, C]: q.k and k.k
        qk, kk = scores[:, :C].mul_(decay), scores[:, C:].mul_(decay)
        # (I + A) U = beta V - beta exp(gamma) K S_0, A strictly lower
        system = kk.mul_(bc[:, :, None]).tril_(-1)
        system.diagonal(dim1=1, dim2=2).fill_(1.0)
        grow = gamma.exp()[:, :, None]                                        # [Hv, C, 1]
        rhs = torch.baddbmm(vc, grow * kc, S, alpha=-1).mul_(bc[:, :, None])  # [Hv, C, Dv]
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        # o_t = exp(gamma_t) S_0^T q_t + sum_{j<=t} exp(gamma_t - gamma_j) (q_t.k_j) u_j
        torch.baddbmm(torch.bmm(grow * qc, S), qk, U, out=out[:, start:end])
        # S_C = exp(gamma_C) S_0 + sum_j exp(gamma_C - gamma_j) k_j u_j^T
        tail = (gamma[:, -1:] - gamma).exp_()                                 # [Hv, C]
        S.mul_(gamma[:, -1].exp()[:, None, None]).baddbmm_((kc * tail[:, :, None]).transpose(1, 2), U)
    return out.transpose(0, 1).to(v.dtype), S


# -- around the rule: the short convolution, the gated norm ------------------------------------------

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution and SiLU of one sequence's tokens: x [T, C], weight [C, K], window
    [C, K - 1] (the previous K - 1 inputs, oldest first; None: zeros, a sequence's start) -> (silu(conv)
    [T, C] in x's dtype, the new window [C, K - 1] in x's dtype: the last K - 1 inputs)."""
    T, channels = x.shape
    kernel = weight.shape[1]
    if weight.shape != (channels, kernel) or (window is not None and window.shape != (channels, kernel - 1)):
        raise ValueError(f"causal_conv1d: x [T, C], weight [C, K], window [C, K - 1]; got {list(x.shape)}, "
                         f"{list(weight.shape)}, {None if window is None else list(window.shape)}")
    past = (torch.zeros(channels, kernel - 1, dtype=x.dtype, device=x.device) if window is None
            else window.to(x.dtype))
    padded = torch.cat([past, x.t()], dim=1)                                  # [C, K - 1 + T]
    y = F.conv1d(padded.float()[None], weight.float()[:, None, :], groups=channels)[0]   # [C, T]
    return F.silu(y).t().to(x.dtype), padded[:, T:].clone()


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: x [B, C], weight [C, K], windows [B, C, K - 1] (updated in place) ->
    silu(conv) [B, C] in x's dtype."""
    full = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=2)             # [B, C, K]
    y = (full.float() * weight.float()).sum(-1)
    windows.copy_(full[:, :, 1:])
    return F.silu(y).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per value head: o, z [..., Dv], weight [Dv] (plain w, not 1 + w) -> weight * rmsnorm(o) * silu(z),
    statistics and gate in fp32, the normed o cast back before the weight as transformers does."""
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (weight * normed * F.silu(z.float())).to(o.dtype)
