"""The proposer interface: reserve slots while scheduling, propose after, roll back after verifying."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence


@dataclass
class Proposal:
    """Up to K tokens to follow a sequence, and the distribution each was drawn from.

    probs [len(token_ids), vocab] or None: None means each token is a point mass (prompt lookup,
    or a greedy draft), which rejection sampling reads as q(token) = 1."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Guesses the tokens that follow each scheduled decode."""

    def reserve(self, seq: Sequence, k: int) -> int:
        """Slots to reserve past `seq`'s end while scheduling (at most `k`). Proposers that know
        their proposal before the step (prompt lookup) reserve only what they will propose."""
        return k

    def guess(self, seq: Sequence) -> int | None:
        """The first token this proposer would propose for `seq` now, where finding it costs next to
        nothing (model-free proposers); None otherwise. Asked on plain steps, so that a text turning
        predictable is noticed without paying for a verify (the adaptive switch's guess streaks)."""
        return None

    @abstractmethod
    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        """One proposal per chunk, of at most `chunk.num_lookahead` tokens each."""

    def prefill(self, chunks: list[ScheduledChunk]) -> None:
        """The target computes these prompt chunks this step; a proposer with its own cache computes
        them too (so that its first proposal does not wait on a whole prompt)."""

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """The target has run these chunks and the engine has advanced their sequences; a proposer that
        reads the target's hidden states (the MTP head) takes them now."""

    def rollback(self, seq: Sequence) -> None:
        """`seq` has been verified: its computed tokens now end at `seq.num_computed_tokens`."""

    def forget(self, seq_id: int) -> None:
        """`seq_id` is gone (finished, aborted or preempted)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies of the shared block tables, for proposers with their own KV pools."""

    def capacity_report(self) -> str | None:
        """A line about the proposer's own memory, if it holds any."""
        return None
