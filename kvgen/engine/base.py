"""What every engine shares: queueing admitted requests, recording sampled tokens, failures, aborts."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
import dataclasses
from dataclasses import dataclass

import torch

from kvgen.cache.policies import CachePolicy
from kvgen.config import EngineConfig
from kvgen.engine.admission import Admission, AdmittedRequest, Prompt, max_model_len_of
from kvgen.errors import InvalidRequestError
from kvgen.loaders import LoadedModel
from kvgen.model.decoder import DecoderModel
from kvgen.sample.grammar import Grammar, GrammarCompiler
from kvgen.sample.sampler import Sampler, SamplerOutput
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import Request, RequestOutput, Sequence, snapshot

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached_free: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from cache
    num_preemptions: int = 0
    spec_proposed: int = 0  # speculative tokens verified
    spec_accepted: int = 0  # of which kept
    spec_verify_steps: int = 0  # sequence-steps that verified a draft
    # a recurrent model's state pool (kvgen.cache.state_pool), apart from the KV blocks: 0 without one
    state_slots_used: int = 0
    state_slots_total: int = 0
    state_bytes_used: int = 0  # the used slots' state
    state_bytes_total: int = 0  # slots, prefix snapshots and verify checkpoints
    state_snapshots: int = 0
    # KV tiers below the pool (kvgen.cache.tiers): per tier, a dict of blocks and bytes held, hits,
    # bytes in and out and seconds spent; () without tiers
    kv_tiers: tuple[tuple[str, dict[str, float]], ...] = ()
    # A mixture of experts' router statistics: per MoE layer, (layer index, tokens routed to each expert
    # since start); () for a dense model
    expert_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()


def sum_stats(readings: Iterable[EngineStats]) -> EngineStats:
    """Several engines' stats as one (the replicas behind one front end): counts add up, and each KV tier's
    readings add up by tier name."""
    readings = list(readings)
    counts = {f.name: sum(getattr(s, f.name) for s in readings)
              for f in dataclasses.fields(EngineStats) if f.name not in ("kv_tiers", "expert_tokens")}
    tiers: dict[str, dict[str, float]] = {}
    for stats in readings:
        for name, reading in stats.kv_tiers:
            total = tiers.setdefault(name, {})
            for key, value in reading.items():
                total[key] = total.get(key, 0) + value
    experts: dict[int, list[int]] = {}
    for stats in readings:
        for layer, tokens in stats.expert_tokens:
            total = experts.setdefault(layer, [0] * len(tokens))
            experts[layer] = [a + b for a, b in zip(total, tokens)]
    return EngineStats(**counts, kv_tiers=tuple(tiers.items()),
                       expert_tokens=tuple((layer, tuple(t)) for layer, t in sorted(experts.items())))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] -> bool [N]: whether each row is usable. A row's sum is NaN or infinite iff
    one of its logits is, or they are so large (~1e34) that it overflows, which is as broken; and it
    is 7-20x cheaper than isfinite().all() (4 ms a step at 64 rows of a 49k vocabulary)."""
    return torch.isfinite(logits.sum(dim=-1))


class Engine(ABC):
    """add_request -> step ... step -> finished outputs. Subclasses decide how each step runs and set
    `model` and `admission` (the rules every request meets once: kvgen.engine.admission)."""

    model: DecoderModel
    admission: Admission

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = max_model_len_of(loaded.config, config)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size)
        self.requests: dict[str, Request] = {}
        self.failure: str | None = None  # why the engine can run no more steps, once it cannot
        # Called with `failure` once that happened and every request failed (`kvgen serve` stops).
        self.on_failure: Callable[[str], None] = lambda _: None

    def close(self) -> None:
        """Releases what the engine holds beyond memory (tensor-parallel workers); idempotent."""

    # -- the public loop ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival: float | None = None) -> Request:
        """Admits a request and queues it; raises InvalidRequestError if it is malformed or could never
        be served."""
        self._check_request_id(request_id)
        return self.add_admitted(request_id, self.admission.admit(prompt, params), arrival)

    def add_admitted(self, request_id: str, admitted: AdmittedRequest, arrival: float | None = None) -> Request:
        """Queues a request that passed admission (this engine's, or a front end's under the same
        rules: kvgen.replicas), without checking it again."""
        self._check_request_id(request_id)
        admitted = self.admission.restore(admitted)
        request = Request(request_id, admitted.token_ids, admitted.params, self.tokenizer, prompt=admitted.prompt,
                          arrival=arrival, policy=admitted.policy, grammar=admitted.grammar)
        self.requests[request_id] = request
        self._enqueue(request)
        return request

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that changed (finished ones last time)."""

    def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and gives its KV blocks back."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish("abort")
                self._release(seq)
        request.metrics.finished = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @abstractmethod
    def stats(self) -> "EngineStats":
        """A snapshot of queue lengths and KV usage, for logs and /metrics."""

    # -- admission's rules, as the engine's callers have read them ------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.admission.encode_prompt(prompt)

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        return self.admission.compile_grammar(params)

    def resolve_policy(self, params: SamplingParams) -> CachePolicy:
        return self.admission.resolve_policy(params)

    # -- shared bookkeeping ---------------------------------------------------------------------

    def sample_and_record(self, rows: list[Sequence], logits: torch.Tensor,
                          verified: SamplerOutput | None = None, verified_rows: list[Sequence] = (),
                          broken: Iterable[Request] = ()) -> list[RequestOutput]:
        """logits [len(rows), vocab] -> a token per row, recorded, then the tokens speculative decoding
        verified (`verified.token_ids[i]` for `verified_rows[i]`, several per sequence). A request
        whose logits are not finite (a model whose activations overflow) fails on its own, as do
        `broken` ones; the other rows go on."""
        finite = finite_rows(logits).tolist()
        broken = set(broken) | {seq.request for seq, ok in zip(rows, finite) if not ok}
        failed = self.fail(broken, "the model produced NaN or infinite logits") if broken else []
        keep = [i for i, seq in enumerate(rows) if seq.request not in broken]
        if len(keep) < len(rows):
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            rows = [rows[i] for i in keep]
        sampled = self.sampler(logits, rows) if rows else SamplerOutput([], [])
        if verified is not None:
            rows = rows + list(verified_rows)
            sampled = SamplerOutput(sampled.token_ids + verified.token_ids, sampled.logprobs + verified.logprobs)
        return (self.record(rows, sampled) if rows else []) + failed

    def record(self, rows: list[Sequence], sampled: SamplerOutput) -> list[RequestOutput]:
        """Appends the sampled tokens, frees finished sequences, returns the changed requests."""
        now = time.monotonic()
        deltas: dict[str, dict[int, tuple[str, list[int]]]] = {}
        for seq, token_id, logprobs in zip(rows, sampled.token_ids, sampled.logprobs):
            if seq.is_finished:  # stopped at an earlier token of its speculative run, or failed
                continue
            text = seq.append_token(token_id, logprobs)
            seq.request.record_token_time(now)
            request_deltas = deltas.setdefault(seq.request.request_id, {})
            old_text, old_ids = request_deltas.get(seq.index, ("", []))
            request_deltas[seq.index] = (old_text + text, old_ids + [token_id])
            if seq.is_finished:
                self._release(seq)
        outputs = []
        for request_id, request_deltas in deltas.items():
            request = self.requests[request_id]
            if request.is_finished:
                request.metrics.finished = now
                del self.requests[request_id]
            outputs.append(snapshot(request, request_deltas))
        return outputs

    def fail(self, requests: Iterable[Request], message: str) -> list[RequestOutput]:
        """Ends the requests with an error (finish reason "error") and gives back what they hold; the
        engine and every other request go on."""
        outputs = []
        for request in requests:
            log.error("%s: failed: %s", request.request_id, message)
            for seq in request.sequences:
                if not seq.is_finished:
                    seq.finish("error")
                    self._release(seq)
            request.error = message
            request.metrics.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
            outputs.append(snapshot(request))
        return outputs

    @abstractmethod
    def _enqueue(self, request: Request) -> None:
        """Hands a new request to the scheduling part of the engine."""

    @abstractmethod
    def _release(self, seq: Sequence) -> None:
        """Gives back whatever a finished or aborted sequence holds."""

