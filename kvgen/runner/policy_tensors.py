"""The tensors a step's cache policies add to its attention groups, beside the runner's layout.

The runner lays out rows, slots and block tables; what each sequence's cache policy changes about
its attention is built here, per group of B sequences, Q queries and L gathered keys:

    mask            [B, Q, L]  causal, within sinks + window (and the layers' own window)
    RoPE positions  [B, Q]     token indices, or ranks in the cache for sinks (capped at S + W - 1)
    key rotation    [B, 1, L, D] (cos, sin): sinks keys re-rotated from their rank when written
                    to their rank now
    heavy hitters   the evicted tokens masked, the rows whose attention weights are collected; the
                    weights go to the cache layer's scores (kvgen.cache.heavy_hitters), which decide
                    what h2o evicts

h2o limits its keys by eviction rather than by the mask: heavy hitters lie outside the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.policies import CachePolicy
from kvgen.model.attention import PagedGroup

FAR = 1 << 40  # logical position of padding keys: later than any query, so always masked


@dataclass
class ScoreTarget:
    """Where a group's accumulated attention weights go: row r of `group.scores` -> seq_ids[r]."""

    group: PagedGroup
    seq_ids: list[int]
    positions: torch.Tensor  # [b, L] token index of each key


class PolicyTensors:
    """Builds the policy tensors of a runner's groups on `device`. `rope_tables(positions)` gives the
    model's RoPE (cos, sin) [..., 1, D] at `positions` (below `max_positions`); `heavy_hitters` is the
    cache layer's h2o state, read for masks and given each step's attention weights."""

    def __init__(self, device: torch.device, rope_tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 max_positions: int, heavy_hitters: HeavyHitters) -> None:
        self.device = device
        self.rope_tables = rope_tables
        self.max_positions = max_positions
        self.heavy_hitters = heavy_hitters

    def mask(self, policies: list[CachePolicy], q_pos: torch.Tensor, k_pos: torch.Tensor,
             layer_window: int | None = None) -> torch.Tensor:
        """[B, Qmax, L]: causal, and inside each sequence's sinks + window and the layers' own window.
        (h2o: heavy hitters lie outside the window, so its keys are limited by eviction, in
        `add_heavy_hitters`, instead.)"""
        mask = k_pos[:, None, :] <= q_pos[:, :, None]
        windows = [min(FAR if p.window is None or p.kind == "h2o" else p.window, layer_window or FAR)
                   for p in policies]
        if all(w == FAR for w in windows):
            return mask
        sinks = torch.tensor([p.sinks for p in policies], device=self.device)[:, None, None]
        window = torch.tensor(windows, device=self.device)[:, None, None]
        recent = k_pos[:, None, :] > q_pos[:, :, None] - window
        return mask & ((k_pos[:, None, :] < sinks) | recent)

    def rope_positions(self, policies: list[CachePolicy], q_pos: torch.Tensor) -> torch.Tensor:
        """[B, Q]: the queries' token indices, capped at S + W - 1 for sinks (RoPE by cache rank)."""
        if not any(p.uses_cache_positions for p in policies):
            return q_pos
        cap = torch.tensor([FAR if p.rope_cap is None else p.rope_cap for p in policies],
                           device=self.device)
        return torch.minimum(q_pos, cap[:, None])

    def add_sink_rotation(self, group: PagedGroup, policies: list[CachePolicy], last_q: torch.Tensor,
                          k_pos: torch.Tensor) -> None:
        """Keys of a sinks sequence were rotated by their rank when written; ranks shift as the window
        slides, so rotate each gathered key by (rank now - rank then), a position <= S + W."""
        if not any(p.uses_cache_positions and last_q[b] >= p.sinks + p.window for b, p in enumerate(policies)):
            return
        is_sinks = torch.tensor([p.uses_cache_positions for p in policies], device=self.device)[:, None]
        sinks = torch.tensor([p.sinks for p in policies], device=self.device)[:, None]
        window = torch.tensor([p.window or 1 for p in policies], device=self.device)[:, None]
        rank_then = torch.minimum(k_pos, sinks + window - 1)
        first_recent = torch.maximum(sinks, last_q[:, None] - window + 1)
        rank_now = torch.where(k_pos < sinks, k_pos, sinks + k_pos - first_recent)
        delta = torch.where(is_sinks, rank_now - rank_then, 0).clamp(-(self.max_positions - 1), 0)
        cos, sin = self.rope_tables(-delta)  # [B, L, 1, D]; rotating by -x flips sin
        group.key_rotation = (cos.transpose(1, 2), -sin.transpose(1, 2))  # [B, 1, L, D]: keys are heads-first

    def add_heavy_hitters(self, group: PagedGroup, seq_ids: Sequence[int], policies: list[CachePolicy],
                          ends: Sequence[int], k_pos: torch.Tensor) -> ScoreTarget | None:
        """h2o sequences (`ends[b]`: the tokens row b has once the step is computed): mask their
        evicted tokens and have the group collect this step's attention weights."""
        rows = [b for b, p in enumerate(policies) if p.kind == "h2o"]
        if not rows:
            return None
        for b in rows:
            state = self.heavy_hitters.state(seq_ids[b], ends[b])
            positions = k_pos[b].clamp(max=state.evicted.numel() - 1)
            group.mask[b] &= ~(state.evicted[positions] & (k_pos[b] < state.evicted.numel()))
        group.score_rows = torch.tensor(rows, device=self.device)
        group.scores = torch.zeros(len(rows), k_pos.shape[1], device=self.device)
        return ScoreTarget(group, [seq_ids[b] for b in rows], k_pos[group.score_rows])

    def collect_scores(self, targets: list[ScoreTarget]) -> None:
        """Hands the step's attention weights to the cache layer's heavy-hitter scores."""
        for target in targets:
            for scores, positions, seq_id in zip(target.group.scores, target.positions, target.seq_ids):
                self.heavy_hitters.add(seq_id, positions, scores)
