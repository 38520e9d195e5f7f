"""What each engine step did, for the dashboard: a bounded ring of the last steps, owned by the engine.

A chunk is decode work when it computes one newly generated token (and the speculative tokens
verified with it); everything else (prompts, and
prompts plus outputs recomputed after a preemption) is prefill work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from kvgen.scheduling.output import ScheduledChunk

DEFAULT_STEP_LOG_LEN = 256


@dataclass(frozen=True)
class StepRecord:
    number: int  # 1 for the engine's first step
    prefill_tokens: int
    decode_tokens: int
    batch_size: int  # sequences computed in the step
    preempted: int
    ms: float
    released: tuple[int, ...]  # block ids a cache policy gave back in the step

    @cached_property
    def as_dict(self) -> dict:
        """JSON-ready, made once: the dashboard sends each record in many snapshots."""
        return {"step": self.number, "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "batch_size": self.batch_size, "preempted": self.preempted, "ms": round(self.ms, 3)}


def split_tokens(chunks: Iterable[ScheduledChunk]) -> tuple[int, int]:
    """(prefill, decode) tokens of a schedule; read before the step runs (it advances the sequences)."""
    prefill = decode = 0
    for chunk in chunks:
        if chunk.num_tokens == 1 + len(chunk.draft) and chunk.completes_sequence and chunk.seq.output_token_ids:
            decode += chunk.num_tokens  # a decode, with the speculative tokens it verifies
        else:
            prefill += chunk.num_tokens
    return prefill, decode


class StepLog:
    """The last `maxlen` steps, oldest first, and how many steps there have been."""

    def __init__(self, maxlen: int = DEFAULT_STEP_LOG_LEN) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.num_steps = 0

    def add(self, tokens: tuple[int, int], batch_size: int, preempted: int, seconds: float,
            released: Iterable[int]) -> None:
        """Records a step that computed `tokens` = (prefill, decode) tokens of `batch_size` sequences."""
        self.num_steps += 1
        self.records.append(StepRecord(self.num_steps, tokens[0], tokens[1], batch_size, preempted,
                                       seconds * 1000.0, tuple(released)))

    def since(self, step: int) -> list[StepRecord]:
        """Records of the steps after `step` still in the ring, oldest first."""
        return [r for r in self.records if r.number > step]
