"""What the bench asks of every system it runs, kvgen's engine (KvgenSystem, here) and its peers alike
(benchmarks.peers, benchmarks.llama_server: the peer harness, outside the package). Every system
generates greedily from token ids and never stops early (EOS ignored), so each produces exactly the
tokens asked for. Two operations:

    generate_timed(prompt, n)  one request alone -> when each output token became available
    run_batch(requests)        requests run together (kvgen: all submitted at once, continuous
                               batching; HF / CTranslate2: one static batch; llama.cpp: one by one;
                               llama-server: all sent at once to its slots)
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvgen.engine.base import Engine
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import Request


class BenchRequest(NamedTuple):
    prompt: list[int]
    output_len: int


@dataclass
class TokenTimes:
    """time.monotonic() at submission and at each output token of one request."""

    start: float
    tokens: list[float]


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why in one line."""


class System(ABC):
    name: str
    #: run_batch runs its requests in one batch (False: one after another).
    batched: bool = True
    #: static batches are cut from the requests sorted by prompt length, as the peer's own batching does
    sorts_by_length: bool = False
    #: what a batch size means to run_at, for the report
    batch_kind: str = "static batch"
    #: seconds from nothing to ready to generate (for a peer: its constructor), set by kvgen bench
    load_s: float | None = None
    #: the KV cache's dtype (as --kv-cache-dtype names it) where weight_bytes() gives this system's own bytes
    kv_dtype: str = "float16"

    def weight_bytes(self) -> int | None:
        """The bytes of matrices a decode step reads, where this system's own differ from kvgen's
        (a GGUF as the file stores it); None: the same as kvgen's (kvgen.bench.latency)."""
        return None

    @abstractmethod
    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        """Runs one request alone and records when each output token appeared."""

    @abstractmethod
    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        """Runs the requests together to completion."""

    def build_note(self) -> str | None:
        """What the report should say of how this peer was built, if anything."""
        return None

    def run_at(self, requests: Sequence[BenchRequest], size: int) -> None:
        """Runs every request at batch size `size`: consecutive static batches, each to completion
        (in arrival order, or by prompt length where the peer's own batching sorts). A server peer
        instead serves them all at once on `size` slots."""
        if self.sorts_by_length:
            requests = sorted(requests, key=lambda r: len(r.prompt))
        for i in range(0, len(requests), size):
            self.run_batch(requests[i:i + size])


class KvgenSystem(System):
    """kvgen's engine, driven through its public add_request / step loop."""

    name = "kvgen"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        request = self._add(BenchRequest(prompt, output_len))
        self._drain()
        return TokenTimes(request.metrics.arrival, list(request.metrics.token_times))

    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        added = [self._add(r) for r in requests]
        self._drain()
        short = [(r.request_id, len(r.sequences[0].output_token_ids)) for r in added
                 if len(r.sequences[0].output_token_ids) != r.params.max_tokens]
        if short:
            raise RuntimeError(f"requests stopped before max_tokens (id, tokens): {short[:3]}")

    def _add(self, request: BenchRequest) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        return self.engine.add_request(f"bench-{next(self._ids)}", request.prompt, params)

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
