"""`kvgen bench serve`: a load generator against a running `kvgen serve`, like vLLM's `bench serve`.

Requests (random token-id prompts and output lengths, EOS ignored) arrive as a Poisson process at
`--rate` per second (`inf`: all at once) and stream from /v1/completions. Per request:

    TTFT  first streamed token - send          E2E   last byte - send
    TPOT  (E2E - TTFT) / (output tokens - 1)   ITL   every gap between streamed chunks

reported as mean / p50 / p90 / p99, with request and token throughput over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np

from kvgen.bench.report import Report, Table, distribution, fmt
from kvgen.bench.system import BenchRequest
from kvgen.bench.workload import make_requests
from kvgen.errors import KVGenError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
REQUEST_TIMEOUT_S = 600.0
LATENCIES = (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("itl_s", "ITL (ms)"), ("e2e_s", "E2E latency (ms)"))


@dataclass
class Outcome:
    """One streamed request as the client saw it (time.monotonic)."""

    prompt_len: int
    sent: float
    chunks: list[float] = field(default_factory=list)
    done: float | None = None
    output_tokens: int = 0
    error: str | None = None

    def latencies(self) -> dict[str, list[float]]:
        if self.error or not self.chunks:
            return {key: [] for key, _ in LATENCIES}
        ttft, e2e = self.chunks[0] - self.sent, self.done - self.sent
        tpot = [(e2e - ttft) / (self.output_tokens - 1)] if self.output_tokens > 1 else []
        return {"ttft_s": [ttft], "tpot_s": tpot, "itl_s": np.diff(self.chunks).tolist(), "e2e_s": [e2e]}


def arrival_offsets(count: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals, or all at 0 for rate inf."""
    if np.isinf(rate):
        return [0.0] * count
    return np.cumsum(rng.exponential(1.0 / rate, count)).tolist()


def check_loopback(url: str) -> None:
    if urlsplit(url).hostname not in LOOPBACK:
        raise KVGenError(f"bench serve only targets this machine (127.0.0.1, localhost, ::1), not {url}")


async def send(client: httpx.AsyncClient, model: str, request: BenchRequest, delay: float) -> Outcome:
    """Waits `delay` seconds, then streams one completion, timing each chunk that carries tokens."""
    await asyncio.sleep(delay)
    outcome = Outcome(len(request.prompt), time.monotonic())
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return outcome
            async for line in response.aiter_lines():
                _on_event(outcome, line)
        outcome.done = time.monotonic()
    except httpx.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}"
    return outcome


def _on_event(outcome: Outcome, line: str) -> None:
    """One server-sent event line: a chunk with a choice is a token arrival; the usage chunk counts them."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data: "):])
    if "error" in event:
        outcome.error = event["error"].get("message", "stream error")
    if event.get("choices"):
        outcome.chunks.append(time.monotonic())
    if event.get("usage"):
        outcome.output_tokens = event["usage"]["completion_tokens"]


async def run_load(url: str, api_key: str | None, requests: list[BenchRequest], offsets: list[float]
                   ) -> tuple[list[Outcome], float, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    # trust_env=False: a proxy from the environment must not sit between the bench and the server.
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()
        model = models["data"][0]["id"]
        start = time.monotonic()
        outcomes = await asyncio.gather(*(send(client, model, r, d) for r, d in zip(requests, offsets)))
        return list(outcomes), time.monotonic() - start, model


def run(args: argparse.Namespace, vocab_size: int, settings: dict) -> Report:
    check_loopback(args.url)
    requests = make_requests(args.num_requests, args.prompt_len_range, args.output_len_range, vocab_size, args.seed)
    offsets = arrival_offsets(len(requests), args.rate, np.random.default_rng(args.seed + 1))
    try:
        outcomes, duration, model = asyncio.run(run_load(args.url.rstrip("/"), args.api_key, requests, offsets))
    except httpx.HTTPError as e:
        raise KVGenError(f"cannot reach the server at {args.url}: {e}") from None
    data = {"settings": settings | {"served_model": model}} | summarize(outcomes, duration)
    return Report("serve", data, [table(data, args)], notes=_errors(outcomes))


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    output = sum(o.output_tokens for o in ok)
    pooled = {key: [v for o in ok for v in o.latencies()[key]] for key, _ in LATENCIES}
    return {
        "completed": len(ok), "failed": len(outcomes) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (output + sum(o.prompt_len for o in ok)) / duration,
        "latency": {key: distribution(values) for key, values in pooled.items()},
    }


def table(data: dict, args: argparse.Namespace) -> Table:
    stats = ["mean", "p50", "p90", "p99"]
    rows = [[label, *(fmt(None if data["latency"][key][s] is None else data["latency"][key][s] * 1e3) for s in stats)]
            for key, label in LATENCIES]
    title = (f"serve: {args.url}, {data['completed']} of {args.num_requests} requests ok at rate {args.rate}/s "
             f"in {data['duration_s']:.2f} s: {fmt(data['requests_per_s'])} req/s, "
             f"{fmt(data['output_tokens_per_s'])} output tok/s, {fmt(data['total_tokens_per_s'])} total tok/s")
    return Table(title, ["latency", *stats], rows)


def _errors(outcomes: list[Outcome]) -> list[str]:
    failed = [o.error for o in outcomes if o.error]
    return [f"{len(failed)} requests failed, first: {failed[0]}"] if failed else []
