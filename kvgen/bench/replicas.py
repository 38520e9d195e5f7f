"""`kvgen bench replicas`: two data-parallel replicas against one engine, on requests that share
system prompts, with prefix-aware routing against round-robin in the same run.

Each configuration is a real `kvgen serve` on a free loopback port, started by the bench:

    N=1               one engine in the server's process, on all of this process's cores
    N=2 prefix        --data-parallel-size 2, --threads-per-replica each, prefix-aware routing
    N=2 round-robin   the same, round-robin routing
    N=2 prefix, Ray   with --ray-address: the prefix configuration with the replicas as Ray actors

The workload: `--num-requests` requests over `--num-prefixes` shared system prompts (random token
ids, `--prefix-len` long), each with its own random suffix and output length (EOS ignored), in a
shuffled order, sent at `--rate` (Poisson; default inf: all at once) and streamed as `kvgen bench
serve` does. Per configuration: requests/s and output tokens/s over the run, and the prefix cache's
hit rate (hits / queries, summed over the replicas, from /metrics read before and after the run,
so a warm-up request does not count). The configurations take turns over `--rounds` rounds, so that
the machine's drift falls on all of them; the table shows each one's median.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvgen.bench.report import Report, Table, fmt
from kvgen.bench.serve import arrival_offsets, run_load, summarize
from kvgen.bench.system import BenchRequest
from kvgen.bench.workload import random_prompt
from kvgen.errors import KVGenError

START_TIMEOUT_S = 300.0
BASELINE = "N=1"


def shared_prefix_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """`num_requests` requests, each a random one of `num_prefixes` shared prompts (equal shares)
    followed by its own random suffix; shuffled."""
    rng = np.random.default_rng(args.seed)
    prefixes = [random_prompt(rng, vocab_size, args.prefix_len) for _ in range(args.num_prefixes)]
    requests = []
    for i in range(args.num_requests):
        suffix = random_prompt(rng, vocab_size, int(rng.integers(args.suffix_len_range[0],
                                                                 args.suffix_len_range[1] + 1)))
        output_len = int(rng.integers(args.output_len_range[0], args.output_len_range[1] + 1))
        requests.append(BenchRequest(prefixes[i % args.num_prefixes] + suffix, output_len))
    return [requests[i] for i in rng.permutation(len(requests))]


def configurations(args: argparse.Namespace, model_path: str) -> dict[str, list[str]]:
    """Each configuration's `kvgen serve` options."""
    base = ["--model", model_path, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs",
            str(args.max_num_seqs)]
    two = [*base, "--data-parallel-size", "2", "--threads-per-replica", str(args.threads_per_replica)]
    configs = {BASELINE: base, "N=2 prefix": [*two, "--router", "prefix"],
               "N=2 round-robin": [*two, "--router", "round-robin"]}
    if args.ray_address:
        configs["N=2 prefix, Ray"] = [*two, "--router", "prefix", "--ray-address", args.ray_address]
    return configs


@contextmanager
def server(options: list[str]) -> Iterator[str]:
    """`kvgen serve OPTIONS` on a free loopback port until the block ends (then SIGTERM); its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvgen", "serve", "--port", str(port), *options],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise KVGenError(f"kvgen serve {' '.join(options)} did not start: {log.read()[-500:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the server's replicas (or its one engine)."""
    totals = {"kvgen_prefix_cache_hits_total": 0.0, "kvgen_prefix_cache_queries_total": 0.0}
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["kvgen_prefix_cache_hits_total"], totals["kvgen_prefix_cache_queries_total"]


def run_one(options: list[str], requests: list[BenchRequest], offsets: list[float]) -> dict:
    with server(options) as url:
        warm_up = [BenchRequest(list(range(3, 19)), 4)]  # loads the kernels; prefixes of its own
        asyncio.run(run_load(url, None, warm_up, [0.0]))
        hits0, queries0 = prefix_counters(url)
        outcomes, duration, _ = asyncio.run(run_load(url, None, requests, offsets))
        hits1, queries1 = prefix_counters(url)
    queries = queries1 - queries0
    return summarize(outcomes, duration) | {"prefix_cache_hit_rate": (hits1 - hits0) / queries if queries else None,
                                            "errors": [o.error for o in outcomes if o.error][:3]}


def run(args: argparse.Namespace, model_path: str, vocab_size: int, settings: dict) -> Report:
    requests = shared_prefix_requests(args, vocab_size)
    offsets = arrival_offsets(len(requests), args.rate, np.random.default_rng(args.seed + 1))
    configs = configurations(args, model_path)
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        names = list(configs)
        names = names[r % len(names):] + names[:r % len(names)]  # each round starts with the next one
        rounds.append({name: run_one(configs[name], requests, offsets) for name in names})
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    summary = {name: _median(rounds, name) for name in configs}
    data = {"settings": settings | {"configurations": configs}, "rounds": rounds, "summary": summary}
    return Report("replicas", data, [_table(summary, args)], notes=_notes(summary, rounds))


def _median(rounds: list[dict[str, dict]], name: str) -> dict:
    keys = ("requests_per_s", "output_tokens_per_s", "prefix_cache_hit_rate")
    return {key: statistics.median(r[name][key] for r in rounds) for key in keys} | {
        "completed": min(r[name]["completed"] for r in rounds), "failed": max(r[name]["failed"] for r in rounds)}


def _table(summary: dict[str, dict], args: argparse.Namespace) -> Table:
    base = summary[BASELINE]["output_tokens_per_s"]
    rows = [[name, f"{s['completed']}/{args.num_requests}", fmt(s["requests_per_s"]), fmt(s["output_tokens_per_s"]),
             f"{s['output_tokens_per_s'] / base:.2f}x", fmt(s["prefix_cache_hit_rate"])]
            for name, s in summary.items()]
    title = (f"replicas: {args.num_requests} requests over {args.num_prefixes} shared {args.prefix_len}-token "
             f"prompts, rate {args.rate}/s, median of {args.rounds} rounds")
    return Table(title, ["configuration", "ok", "req/s", "output tok/s", "vs N=1", "prefix hit rate"], rows)


def _notes(summary: dict[str, dict], rounds: list[dict[str, dict]]) -> list[str]:
    notes = []
    if "N=2 prefix" in summary and "N=2 round-robin" in summary:
        ratios = [r["N=2 prefix"]["prefix_cache_hit_rate"] / r["N=2 round-robin"]["prefix_cache_hit_rate"]
                  for r in rounds if r["N=2 round-robin"]["prefix_cache_hit_rate"]]
        notes.append("prefix-cache hit rate, prefix-aware over round-robin routing, per round: "
                     + ", ".join(f"{x:.2f}x" for x in ratios))
    failed = {name: r[name]["errors"] for r in rounds for name in r if r[name]["errors"]}
    notes += [f"{name}: requests failed, e.g. {errors[0]}" for name, errors in failed.items()]
    return notes
