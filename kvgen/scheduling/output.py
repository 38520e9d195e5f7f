"""What the scheduler hands the runner each step: the contract between the two, in its own module so
that the runner reads it without importing the scheduler (as vLLM's SchedulerOutput).

A step is a list of chunks: `num_tokens` new tokens of one sequence from its first token without K/V,
plus the slots reserved past its end for speculative tokens and the draft verified in the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgen.scheduling.sequence import Sequence


@dataclass
class ScheduledChunk:
    """`num_tokens` new tokens of `seq`, starting at its first token without K/V."""

    seq: Sequence
    num_tokens: int
    num_lookahead: int = 0  # slots reserved past the sequence's end for speculative tokens
    draft: list[int] = field(default_factory=list)  # proposed tokens verified in this chunk (after its last)
    verify_row: int | None = None  # a recurrent model's verify chunk: its state checkpoint row (kvgen.cache.state_pool)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the newest token, so a next token will be sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens + len(self.draft)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes: the sequence's from `start`, then its draft."""
        start = self.start
        if not self.draft:
            return self.seq.token_ids[start : start + self.num_tokens]
        return (self.seq.token_ids[start:] + self.draft)[: self.num_tokens]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)
