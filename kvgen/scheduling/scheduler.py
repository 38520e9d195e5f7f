"""Who runs this step, and how many tokens each: continuous batching with chunked prefill.

Every step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running sequences go first (decodes, and the next chunk of prompts already being prefilled), then
waiting ones in arrival order (FCFS) while budget, sequence slots and KV blocks last. A prompt longer
than the remaining budget is split across steps (chunked prefill), so decodes keep flowing.

When the block pool runs dry the newest running sequence is preempted: its blocks go back to the
pool (full ones stay in the prefix cache) and it waits to be recomputed. Requests that could never
fit are refused by the engine at admission, so this loop cannot livelock.

Speculative decoding: a running decode that the engine's `lookahead` gives K > 0 costs K + 1 tokens
of the budget and K + 1 slots (its last token plus K proposed ones, verified together), if the pool
has them without preempting anyone; the engine proposes the tokens after scheduling and takes back
the slots of those rejected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvgen.cache.kv_manager import KVCacheManager
from kvgen.scheduling.output import ScheduledChunk, SchedulerOutput
from kvgen.scheduling.sequence import Sequence, Status
from kvgen.scheduling.state_slots import StateSlots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


class Scheduler:
    """Holds the waiting queue and the running list; the KV cache manager holds their blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 lookahead: Callable[[Sequence], int] | None = None, states: StateSlots | None = None) -> None:
        self.config = config
        self.kv = kv
        self.lookahead = lookahead  # speculative tokens to reserve for a running decode (None: no speculation)
        self.states = states  # a recurrent model's state slots, one per running sequence
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a fork of a running one) joins the running list."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = self._chunk_size(seq, seq.num_computed_tokens, budget)
            lookahead = self._allocate_lookahead(seq, budget)
            if lookahead or self._allocate_or_preempt(seq, num_tokens, out):
                out.chunks.append(ScheduledChunk(seq, num_tokens + lookahead, lookahead))
                budget -= num_tokens + lookahead
                i += 1
        return budget

    def _allocate_lookahead(self, seq: Sequence, budget: int) -> int:
        """Allocates a decode's token plus its speculative slots (within the budget); returns how many
        slots past its end it got: 0 when it does not speculate or the pool has no room for them
        (speculation never preempts anyone; the decode then goes plainly)."""
        if self.lookahead is None or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        lookahead = max(0, min(self.lookahead(seq), budget - 1))
        if lookahead and self.kv.allocate(seq.seq_id, seq.token_ids, 1 + lookahead, num_lookahead=lookahead):
            return lookahead
        return 0

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Finds blocks for `seq`, preempting the newest running sequences; False if `seq` itself went."""
        while not self.kv.allocate(seq.seq_id, seq.token_ids, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.states is not None and not self.states.can_admit(seq):
                break
            reuse = seq.may_reuse_cached_prefix
            cached = self.kv.find_cached_prefix(seq.token_ids, seq.policy.prefix_key) if reuse else []
            if self.states is not None:  # a hit must also find the recurrent layers' state where it ends
                cached = self.states.usable_prefix(seq, cached)
            num_cached = len(cached) * self.kv.block_size
            num_tokens = self._chunk_size(seq, num_cached, budget)
            if not self.kv.allocate(seq.seq_id, seq.token_ids, num_tokens, cached_prefix=cached):
                break
            if self.states is not None:
                self.states.admit(seq, cached)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

    def _chunk_size(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens to compute from `start`: the rest of the sequence, within budget, the policy's limit and
        (a recurrent model's) the next state snapshot boundary."""
        limits = [seq.policy.max_chunk(start), self.states.chunk_limit(seq, start) if self.states else None]
        return min(seq.num_tokens - start, budget, *(limit for limit in limits if limit is not None))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        if self.states is not None:
            self.states.release(seq)
        seq.num_computed_tokens = seq.num_dead_blocks = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Frees a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        if self.states is not None:
            self.states.release(seq)
