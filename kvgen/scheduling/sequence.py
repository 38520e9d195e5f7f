"""Request and sequence state: tokens, lifecycle, stop conditions, incremental text, timings.

A request with n completions owns n sequences. Sequences move

    WAITING -> RUNNING -> FINISHED
       ^          |
       +----------+  (preempted: blocks given back, recomputed later)
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from kvgen.cache.policies import CachePolicy
from kvgen.sample.grammar import Grammar
from kvgen.sample.sampler import TokenLogprobs
from kvgen.sampling_params import SamplingParams
from kvgen.tokenizer import IncrementalDetokenizer, Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request, and the figures users ask for."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    spec_proposed: int = 0  # speculative tokens verified for the request
    spec_accepted: int = 0  # of which kept
    spec_verify_steps: int = 0  # steps that verified speculative tokens for it

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verifying step (accepted + the target's own), None if never speculated."""
        return (self.spec_accepted + self.spec_verify_steps) / self.spec_verify_steps if self.spec_verify_steps else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def mean_time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (TPOT)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


_seq_ids = itertools.count()


class Sequence:
    """One completion being generated: its tokens, how many have K/V computed, its stop state."""

    def __init__(self, request: "Request", index: int, params: SamplingParams, tokenizer: Tokenizer,
                 policy: CachePolicy) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.params = params
        self.policy = policy
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output, kept in step
        self.logprobs: list[TokenLogprobs] = []
        self.num_computed_tokens = 0
        self.num_dead_blocks = 0  # table entries below this a bounded cache policy has given back
        self.num_preemptions = 0
        self.state_slot: int | None = None  # a recurrent model's state slot while it runs (kvgen.cache.state_pool)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.grammar = request.grammar.matcher() if request.grammar is not None else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.stop_token_ids))
        self.text = ""
        self._pending_text = ""  # text held back because it might be the start of a stop string

    @property
    def may_reuse_cached_prefix(self) -> bool:
        """Cached prefix blocks skip computing their tokens: fine unless the policy keys differ or the
        request wants every prompt token scored."""
        return self.policy.shares_prefixes and self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> str:
        """Records a sampled token, checks every stop condition, returns the new visible text."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        # A finished grammar has taken a stop token (under ignore_eos too: nothing else is allowed).
        if token_id in self.stop_ids or (self.grammar is not None and self.grammar.accept(token_id)):
            return self._finish("stop", self._release_pending())
        delta = self._pending_text + self.detokenizer.add([token_id])
        stopped, delta = self._cut_at_stop_string(delta)
        if stopped:
            return self._finish("stop", delta)
        if len(self.output_token_ids) >= self.params.max_tokens:
            return self._finish("length", delta)
        return self._emit_safe(delta)

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def _finish(self, reason: str, delta: str) -> str:
        self.finish(reason)
        self.text += delta
        return delta

    def _release_pending(self) -> str:
        delta, self._pending_text = self._pending_text, ""
        return delta

    def _cut_at_stop_string(self, delta: str) -> tuple[bool, str]:
        """Stop strings are searched in the text not yet shown; the output ends just before them."""
        candidates = [(delta.find(s), s) for s in self.params.stop if s in delta]
        if not candidates:
            return False, delta
        at = min(pos for pos, _ in candidates)
        self._pending_text = ""
        return True, delta[:at]

    def _emit_safe(self, delta: str) -> str:
        """Holds back a tail that could be the start of a stop string, emits the rest."""
        hold = max((_overlap(delta, s) for s in self.params.stop), default=0)
        self._pending_text = delta[len(delta) - hold :] if hold else ""
        shown = delta[: len(delta) - hold]
        self.text += shown
        return shown


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


class Request:
    """A user's request: a prompt, its parameters, and n sequences that complete it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, prompt: str | None = None, arrival: float | None = None,
                 policy: CachePolicy | None = None, grammar: Grammar | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.policy = policy or params.cache_policy
        self.metrics = RequestMetrics(arrival=time.monotonic() if arrival is None else arrival)
        self.grammar = grammar
        self.sequences = [Sequence(self, i, params.for_completion(i), tokenizer, self.policy)
                          for i in range(params.n)]
        # Log-probability of each prompt token given the ones before it (None for the first).
        self.prompt_logprobs: list[TokenLogprobs | None] = [None] if params.prompt_logprobs is not None else []
        self.error: str | None = None  # why the engine failed the request, if it did

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    def record_token_time(self, now: float) -> None:
        if self.metrics.first_token is None:
            self.metrics.first_token = now
        self.metrics.token_times.append(now)


@dataclass
class CompletionOutput:
    """One completion of a request, cumulative. `new_text` / `new_token_ids` are what this step added.

    While the request runs, `token_ids` is the engine's live list (copying it every step would make
    each step O(length)); it is a private copy once the request has finished.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """The state of a request after a step (or at the end). `text` etc. are those of completion 0."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # set when the engine failed the request (finish reason "error")

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def snapshot(request: Request, deltas: dict[int, tuple[str, list[int]]] | None = None) -> RequestOutput:
    """A RequestOutput of the request now; `deltas` maps sequence index -> (new text, new ids)."""
    deltas = deltas or {}
    outputs = [
        CompletionOutput(
            index=seq.index, text=seq.text, finish_reason=seq.finish_reason,
            token_ids=list(seq.output_token_ids) if seq.is_finished else seq.output_token_ids,
            new_text=deltas.get(seq.index, ("", []))[0], new_token_ids=deltas.get(seq.index, ("", []))[1],
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )
        for seq in request.sequences
    ]
    prompt_logprobs = list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                         request.is_finished, request.metrics, prompt_logprobs, request.error)
