"""Heavy hitters (the h2o policy): the attention each token of a sequence has received, and which
tokens the policy has evicted. The cache layer owns this state, beside the block tables it decides
over: the runner adds each step's attention weights here (and masks what was evicted), the engine
asks here which blocks died once a step is computed, and hands them to the KV manager. No pass
through the runner.

    scores   [capacity] fp32 by token index: the attention weight every later query gave the token
    evicted  [capacity] bool: tokens no later query reads

After each step the `heavy` best-scored tokens outside the window are kept and the rest evicted; a
block whose every token is evicted goes back to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.cache.policies import CachePolicy


@dataclass
class HeavyHitterState:
    """Accumulated attention per token of an h2o sequence, and which tokens it has evicted."""

    scores: torch.Tensor  # [capacity] fp32, by token index
    evicted: torch.Tensor  # [capacity] bool

    def grow(self, length: int) -> None:
        if length > self.scores.numel():
            extra = max(length, 2 * self.scores.numel()) - self.scores.numel()
            self.scores = torch.cat((self.scores, self.scores.new_zeros(extra)))
            self.evicted = torch.cat((self.evicted, self.evicted.new_zeros(extra)))


class HeavyHitters:
    """Every h2o sequence's state, on the device the model runs on."""

    def __init__(self, device: torch.device | str, block_size: int) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.states: dict[int, HeavyHitterState] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.states

    def state(self, seq_id: int, length: int) -> HeavyHitterState:
        """The sequence's state, grown to hold `length` tokens (created on its first step)."""
        state = self.states.setdefault(seq_id, HeavyHitterState(
            torch.zeros(0, device=self.device), torch.zeros(0, dtype=torch.bool, device=self.device)))
        state.grow(length)
        return state

    def add(self, seq_id: int, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Adds one step's attention weights `scores` [L] of the keys at token indices `positions` [L]
        (padding keys lie past the state and are skipped)."""
        state = self.states[seq_id]
        real = positions < state.scores.numel()
        state.scores.index_add_(0, positions[real], scores[real])

    @torch.inference_mode()
    def evict(self, seq_id: int, num_computed: int, policy: CachePolicy) -> list[int]:
        """Keeps the `heavy` highest-scoring tokens outside the window; returns the indices of blocks
        whose every token is now evicted (the caller gives them back to the pool)."""
        state = self.states[seq_id]
        first_recent = num_computed - policy.window + 1
        candidates = (~state.evicted[:num_computed]).nonzero().flatten()
        candidates = candidates[candidates < first_recent]
        excess = candidates.numel() - policy.heavy
        if excess <= 0:
            return []
        order = torch.sort(state.scores[candidates], stable=True).indices
        state.evicted[candidates[order[:excess]]] = True
        full_blocks = num_computed // self.block_size
        dead = state.evicted[: full_blocks * self.block_size].view(full_blocks, self.block_size).all(dim=1)
        return dead.nonzero().flatten().tolist()

    @torch.inference_mode()
    def fork(self, parent_id: int, child_id: int) -> None:
        """A completion forked off `parent_id` starts with its scores (copy-on-write of the blocks)."""
        state = self.states.get(parent_id)
        if state is not None:
            self.states[child_id] = HeavyHitterState(state.scores.clone(), state.evicted.clone())

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
