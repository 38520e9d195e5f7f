"""A draft model that lets suffix decoding propose where the text repeats (as Arctic Inference pairs
suffix decoding with its draft heads).

A draft pass reads the whole draft model, and K of them a step cost as much as the verify on the
real Qwen2.5-Coder pair (docs/performance-notes.md). Where a sequence copies text it has seen (a
file it edits, a passage it quotes), the suffix tree proposes the same tokens for a dictionary walk.
So each step, per sequence: if the tree matches the context's last `min_match` tokens or more, its
proposal is taken and the draft does not run for that sequence; else the draft proposes. The draft
computes the tokens it skipped with its next pass (its catch-up), so its cache never goes stale.
First-token acceptance by match length, on the real SmolLM2's edit task: 21-37% at 1-2 tokens of
match, 50-71% at 3, 89-100% from 5, hence the default of 5.
"""

from __future__ import annotations

from kvgen.engine.speculative.proposer import Proposal, Proposer
from kvgen.engine.speculative.suffix import SuffixProposer
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence


class SuffixFirst(Proposer):
    """`model`'s proposals, but the suffix tree's where it matches `min_match` tokens or more."""

    def __init__(self, model: Proposer, min_match: int, suffix: SuffixProposer | None = None) -> None:
        self.model, self.min_match = model, min_match
        self.suffix = suffix if suffix is not None else SuffixProposer()
        self.from_suffix = 0  # proposals the tree made, for the tests and the bench's notes
        self._found: dict[int, list[int]] = {}  # seq_id -> the tree's proposal this step

    def reserve(self, seq: Sequence, k: int) -> int:
        found = self.suffix.find(seq, k)
        if found.tokens and found.match >= self.min_match:
            self._found[seq.seq_id] = found.tokens
            return len(found.tokens)
        self._found.pop(seq.seq_id, None)
        return self.model.reserve(seq, k)

    def guess(self, seq: Sequence) -> int | None:
        return self.suffix.guess(seq)

    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        found, self._found = self._found, {}  # a sequence preempted after reserving leaves nothing behind
        drafted = iter(self.model.propose([c for c in chunks if c.seq.seq_id not in found]))
        self.from_suffix += sum(c.seq.seq_id in found for c in chunks)
        return [Proposal(found[c.seq.seq_id][: c.num_lookahead]) if c.seq.seq_id in found else next(drafted)
                for c in chunks]

    def prefill(self, chunks: list[ScheduledChunk]) -> None:
        self.model.prefill(chunks)

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        self.model.observe(chunks)

    def rollback(self, seq: Sequence) -> None:
        self.model.rollback(seq)

    def forget(self, seq_id: int) -> None:
        self.suffix.forget(seq_id)
        self.model.forget(seq_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.model.copy_blocks(copies)

    def capacity_report(self) -> str | None:
        return self.model.capacity_report()
