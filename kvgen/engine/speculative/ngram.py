"""Prompt lookup decoding: text that repeats or edits its input is predicted by the input itself.

For n from `max_n` down to `min_n`, find the latest earlier occurrence of the last n tokens of the
prompt + output so far; propose the (up to K) tokens that followed it:

    tokens   ... the cat sat on the mat . the cat |
    n = 2    "the cat" occurred at 0 -> propose "sat on the mat" (K = 4)
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvgen.engine.speculative.proposer import Proposal, Proposer
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence


def lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up to `k` tokens after the latest earlier occurrence of the longest matching suffix."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]: starts 0 .. length - n - 1
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer(Proposer):
    """Proposals are found while scheduling (so only what is proposed is reserved) and handed out after."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._found: dict[int, list[int]] = {}  # seq_id -> the proposal reserved this step

    def reserve(self, seq: Sequence, k: int) -> int:
        found = lookup(seq.token_ids, k, self.min_n, self.max_n)
        self._found[seq.seq_id] = found
        return len(found)

    def guess(self, seq: Sequence) -> int | None:
        found = lookup(seq.token_ids, 1, self.min_n, self.max_n)
        return found[0] if found else None

    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        found, self._found = self._found, {}  # a sequence preempted after reserving leaves nothing behind
        return [Proposal(found.get(c.seq.seq_id, [])[: c.num_lookahead]) for c in chunks]
