"""The reference engine: one sequence at a time through `kvgen.phases` (contiguous cache or none).

It exists to compare against: `kv_cache="contiguous"` is the textbook preallocated cache and
`kv_cache="none"` recomputes everything each step. Requests queue and run in arrival order.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from kvgen.engine.admission import Admission
from kvgen.engine.base import Engine, EngineStats
from kvgen.engine.executor import load_model, log_weights
from kvgen.phases import DecodeState, decode, prefill
from kvgen.scheduling.sequence import Request, RequestOutput, Sequence, Status

log = logging.getLogger(__name__)


class SequentialEngine(Engine):
    """Each step advances the oldest unfinished sequence by one token (its prefill on the first step)."""

    def __init__(self, loaded, config) -> None:
        super().__init__(loaded, config)
        self.model = load_model(loaded, config)
        log_weights(self.model)
        # No block pool: any prompt that fits the context runs, under the model's own cache policy.
        self.admission = Admission(self.tokenizer, loaded.config, self.max_model_len, grammars=self.grammars)
        self.queue: deque[Sequence] = deque()
        self.states: dict[int, DecodeState] = {}

    def step(self) -> list[RequestOutput]:
        if not self.queue:
            return []
        seq = self.queue[0]
        try:
            return self.sample_and_record([seq], self._next_logits(seq)[None])
        except Exception as error:  # noqa: BLE001 - a fault fails this request, not the engine
            log.exception("engine step failed")
            return self.fail([seq.request], f"internal error: {error!r}")

    def _next_logits(self, seq: Sequence) -> torch.Tensor:
        """Prefill on the first step of a sequence, then one decode per step."""
        if seq.seq_id not in self.states:
            seq.status = Status.RUNNING
            seq.request.metrics.first_scheduled = time.monotonic()
            logits, self.states[seq.seq_id] = prefill(self.model, seq.prompt_token_ids, self.config.kv_cache,
                                                      max_seq=self.max_model_len)
            return logits
        logits, _ = decode(self.model, self.states[seq.seq_id], seq.output_token_ids[-1])
        return logits

    def stats(self) -> EngineStats:
        """One sequence runs at a time; its cache is the only one allocated ("blocks" = sequences)."""
        running = len(self.states)
        return EngineStats(num_running=running, num_waiting=len(self.queue) - running,
                           kv_blocks_used=running, kv_blocks_total=1)

    def _enqueue(self, request: Request) -> None:
        self.queue.extend(request.sequences)

    def _release(self, seq: Sequence) -> None:
        if seq in self.queue:
            self.queue.remove(seq)
        self.states.pop(seq.seq_id, None)
