"""`kvgen bench throughput`: R requests with random prompt and output lengths, all at once.

kvgen gets every request submitted together (continuous batching); `--sequential` runs the same
requests one at a time through the same engine. Static-batching peers (HF, CTranslate2) try each
batch size and keep their fastest; their padding costs them time but only the requested output
tokens count. HF's batches are cut in arrival order; CTranslate2's from the requests sorted by
prompt length, as its own `max_batch_size` batching does. llama-server gets every request at once,
like kvgen, with each batch size as its slot count (`--parallel`), and keeps its fastest; each size
is warmed up untimed first, so a server's start is not counted. EOS is ignored everywhere, so every
system produces the same number of tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from kvgen.bench.report import Metric, Report, comparison_table, timed
from kvgen.bench.system import KvgenSystem
from kvgen.bench.system import BenchRequest, System
from kvgen.bench.workload import make_requests

METRICS = (
    Metric("requests_per_s", "requests/s"),
    Metric("output_tokens_per_s", "output tokens/s"),
    Metric("total_tokens_per_s", "total tokens/s"),
)


def run(args: argparse.Namespace, vocab_size: int, kvgen: KvgenSystem, peers: Sequence[System],
        settings: dict, variants: Sequence[KvgenSystem] = ()) -> Report:
    """`variants`: other kvgen engines run like kvgen (such as kvgen-plain, without speculation)."""
    rounds = [make_requests(args.num_requests, args.prompt_len_range, args.output_len_range, vocab_size,
                            args.seed + 2 * r) for r in range(args.rounds)]
    requests = rounds[0]
    warmup = make_requests(1, args.prompt_len_range, (8, 8), vocab_size, args.seed + 1)
    device = kvgen.engine.model.device
    results = alternate_rounds([kvgen, *variants], rounds, warmup, device)
    if args.sequential:
        results["kvgen-sequential"] = rates(requests, timed(lambda: kvgen.run_at(requests, 1), device))
    notes = []
    for peer in peers:
        sizes = sorted({min(b, len(requests)) for b in args.batch_sizes}) if peer.batched else [1]
        results[peer.name] = best_batch_size(peer, requests, sizes, warmup, device)
        notes.append(f"{peer.name}: " + (f"best {peer.batch_kind} {results[peer.name]['batch_size']} of {sizes}"
                                         if peer.batched else "one request at a time (no batched generate)"))
    title = (f"throughput: {settings['model']}, {settings['dtype']}, {len(requests)} requests, prompts "
             f"{args.prompt_len_range[0]}-{args.prompt_len_range[1]}, outputs "
             f"{args.output_len_range[0]}-{args.output_len_range[1]} tokens")
    if args.rounds > 1:
        title += f"; kvgen engines over {args.rounds} alternating rounds of such requests, peers over the first"
    table, ratios = comparison_table(title, METRICS, results)
    settings = settings | {"num_requests": len(requests), "prompt_len_range": args.prompt_len_range,
                           "output_len_range": args.output_len_range, "batch_sizes": args.batch_sizes,
                           "rounds": args.rounds}
    data = {"settings": settings, "results": results, "ratios": ratios,
            "requests": [{"prompt_len": len(r.prompt), "output_len": r.output_len} for r in requests]}
    return Report("throughput", data, [table], notes)


def alternate_rounds(engines: Sequence[KvgenSystem], rounds: Sequence[Sequence[BenchRequest]],
                     warmup: Sequence[BenchRequest], device: torch.device) -> dict[str, dict]:
    """Each engine runs each round's requests, the engines taking turns round by round, so that this
    machine's drift over minutes falls on all of them alike; rates over every round's requests.
    Rounds have their own prompts: none finds another's in the prefix cache."""
    for engine in engines:
        engine.run_batch(warmup)
    elapsed = {engine.name: 0.0 for engine in engines}
    for requests in rounds:
        for engine in engines:
            elapsed[engine.name] += timed(lambda e=engine: e.run_batch(requests), device)
    every = [r for requests in rounds for r in requests]
    return {name: rates(every, seconds) | {"rounds": len(rounds)} for name, seconds in elapsed.items()}


def best_batch_size(peer: System, requests: Sequence[BenchRequest], sizes: Sequence[int],
                    warmup: Sequence[BenchRequest], device: torch.device) -> dict:
    """Runs every request at each batch size (System.run_at); keeps the fastest size. Each size is
    warmed up untimed first, so that a server peer's start at a new slot count (loading and
    repacking its weights) is not charged to its throughput."""
    elapsed = {}
    for size in sizes:
        peer.run_at(warmup, size)
        elapsed[size] = timed(lambda: peer.run_at(requests, size), device)
    best = min(elapsed, key=elapsed.get)
    return rates(requests, elapsed[best]) | {"batch_size": best, "elapsed_s_by_batch_size": elapsed}



def rates(requests: Sequence[BenchRequest], elapsed: float) -> dict:
    """Throughput counting only the requested tokens (padding and overshoot excluded)."""
    output = sum(r.output_len for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": output / elapsed,
            "total_tokens_per_s": (prompt + output) / elapsed, "output_tokens": output, "prompt_tokens": prompt}
