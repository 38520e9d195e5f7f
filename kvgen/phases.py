"""The two phases of autoregressive generation, explicit, for one sequence.

    logits, state = prefill(model, prompt_token_ids)   # whole prompt once, fills every layer's cache
    logits, state = decode(model, state, token_id)     # one new token: its Q/K/V only, attends the cache

`kv_cache="contiguous"` keeps a preallocated cache of shape [batch, kv_heads, seq, head_dim] per layer,
so each decode step costs O(t). `kv_cache="none"` stores nothing and recomputes the whole sequence
every step, O(t^2) per step: the baseline that the cache is measured against. Both give identical
tokens. The batched engine (`kvgen.engine`) does the same over a paged cache for many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgen.model.attention import ContiguousAttention, NoCacheAttention

from kvgen.model.kv_storage import ContiguousKVCache
from kvgen.model.linear import RowKernels, blas_owns_the_cores
from kvgen.model.decoder import DecoderModel

KV_MODES = ("contiguous", "none")


@dataclass
class DecodeState:
    """A sequence being generated: its tokens so far and, unless recomputing, its KV cache."""

    token_ids: list[int] = field(default_factory=list)
    cache: ContiguousKVCache | None = None
    prompt_len: int = 0  # prompt tokens are computed by GEMM, generated ones by GEMV (see model.linear)


def prefill(model: DecoderModel, prompt_token_ids: list[int], kv_cache: str = "contiguous",
            max_seq: int | None = None) -> tuple[torch.Tensor, DecodeState]:
    """Runs the prompt once; returns the last position's logits [vocab] and the state to decode from."""
    if kv_cache not in KV_MODES:
        raise ValueError(f"kv_cache must be one of {KV_MODES}, not {kv_cache!r}")
    cfg = model.config
    state = DecodeState(token_ids=list(prompt_token_ids), prompt_len=len(prompt_token_ids))
    if kv_cache == "contiguous":
        state.cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                        max_seq or model.max_positions, model.device, model.dtype,
                                        [(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in range(cfg.num_layers)])
    return _run(model, state, start=0), state


def decode(model: DecoderModel, state: DecodeState, token_id: int) -> tuple[torch.Tensor, DecodeState]:
    """Appends one token; returns its logits [vocab]. With a cache only the new token is computed."""
    state.token_ids.append(token_id)
    start = 0 if state.cache is None else state.cache.length
    return _run(model, state, start), state


@torch.inference_mode()
def _run(model: DecoderModel, state: DecodeState, start: int) -> torch.Tensor:
    windows = [model.config.window(layer) for layer in range(model.config.num_layers)]
    if state.cache is None:
        attention = NoCacheAttention(windows)
    else:
        if len(state.token_ids) > state.cache.max_seq:
            raise ValueError(f"sequence of {len(state.token_ids)} tokens exceeds the cache ({state.cache.max_seq})")
        attention = ContiguousAttention(state.cache, start, windows)
    new_ids = torch.tensor(state.token_ids[start:], device=model.device)
    positions = torch.arange(start, len(state.token_ids), device=model.device)
    rows = RowKernels.split(len(new_ids), num_gemv_last=max(len(state.token_ids) - max(state.prompt_len, start), 0))
    last = RowKernels.split(1, num_gemv_last=int(len(state.token_ids) > state.prompt_len))
    with blas_owns_the_cores(model.device, model.dtype, gemv_only=not rows.gemm):
        hidden = model.forward(new_ids, positions, attention, rows)
        logits = model.logits(hidden[-1:], last)[0]
    if state.cache is not None:
        state.cache.length = len(state.token_ids)
    return logits
