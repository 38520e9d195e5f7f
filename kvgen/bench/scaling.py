"""`kvgen bench scaling`: what a decode step costs at position t, with and without a KV cache.

Without a cache, step t recomputes all t + 1 tokens: O(t) in the matmuls and O(t^2) in attention, so
n tokens cost O(n^2)..O(n^3) in total. With a cache a step computes one token and reads t cached K/V:
constant weight traffic plus O(t), so O(n)..O(n^2) in total. Both exponents are fitted on log-log axes.

Generating every token without a cache up to 2048 would take hours on a small CPU, so single decode
steps are timed at a geometric set of positions (the state at t is built by a prefill, or for `none`
is just the token list), and the total for n tokens is the sum of the interpolated step times.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import numpy as np

from kvgen.bench.report import Report, Table, fmt, loglog_slope, median, timed
from kvgen.bench.system import KvgenSystem
from kvgen.bench.workload import random_prompt
from kvgen.model.decoder import DecoderModel
from kvgen.phases import DecodeState, decode, prefill

SPEEDUP_AT = (128, 512, 2048)
FIRST_POSITION = 8


def positions(max_position: int, points: int) -> list[int]:
    """About `points` geometrically spaced positions in [FIRST_POSITION, max_position], plus SPEEDUP_AT."""
    start = min(FIRST_POSITION, max_position)
    grid = np.geomspace(start, max_position, points).round().astype(int).tolist()
    return sorted(set(grid) | {n for n in SPEEDUP_AT if start <= n <= max_position})


def phase_step_time(model: DecoderModel, ids: list[int], t: int, steps: int, kv_cache: str) -> float:
    """Median time of `steps` decode steps from position t through `kvgen.phases`."""
    if kv_cache == "none":
        state = DecodeState(token_ids=ids[:t])  # nothing to compute until the step itself
    else:
        _, state = prefill(model, ids[:t], kv_cache, max_seq=t + steps)
    return median([timed(lambda i=i: decode(model, state, ids[t + i]), model.device) for i in range(steps)])


def engine_step_time(kvgen: KvgenSystem, ids: list[int], t: int, steps: int) -> float:
    """Median gap between output tokens 1..steps+1 of a t-token prompt in the paged engine."""
    times = kvgen.generate_timed(ids[:t], steps + 1).tokens
    return median(np.diff(times).tolist())


def total_times(at: Sequence[int], step_s: Sequence[float], ns: Sequence[int]) -> list[float]:
    """Seconds to generate n tokens one by one: the step times, interpolated, summed over t = 0..n-1."""
    steps = np.interp(np.arange(max(ns)), at, step_s)
    cumulative = np.cumsum(steps)
    return [float(cumulative[n - 1]) for n in ns]


def run(args: argparse.Namespace, kvgen: KvgenSystem, max_len: int, settings: dict) -> Report:
    if max_len - args.steps - 1 < FIRST_POSITION:
        raise ValueError(f"--max-len {max_len} leaves no room: it must exceed {FIRST_POSITION} + --steps + 1")
    model = kvgen.engine.model
    ids = random_prompt(np.random.default_rng(args.seed), model.config.vocab_size, max_len + 1)
    at = positions(max_len - args.steps - 1, args.points)
    measures: dict[str, Callable[[int], float]] = {
        "none": lambda t: phase_step_time(model, ids, t, args.steps, "none"),
        "contiguous": lambda t: phase_step_time(model, ids, t, args.steps, "contiguous"),
        "paged": lambda t: engine_step_time(kvgen, ids, t, args.steps),
    }
    for measure in measures.values():
        measure(at[0])  # warm-up
    ns = [n for n in sorted(set(at) | {n for n in SPEEDUP_AT if n <= max_len}) if n >= at[0]]
    results = {name: series(at, [measure(t) for t in at], ns) for name, measure in measures.items()}
    speedups = {n: {kind: results["none"]["total_s"][ns.index(n)] / results[kind]["total_s"][ns.index(n)]
                    for kind in ("contiguous", "paged")} for n in SPEEDUP_AT if n in ns}
    data = {"settings": settings | {"max_len": max_len, "points": args.points, "steps": args.steps},
            "results": results, "speedup_over_none": speedups}
    return Report("scaling", data, tables(results, speedups, settings))


def series(at: list[int], step_s: list[float], ns: list[int]) -> dict:
    total = total_times(at, step_s, ns)
    return {"positions": at, "step_s": step_s, "step_slope": loglog_slope(at, step_s),
            "n": ns, "total_s": total, "total_slope": loglog_slope(ns, total)}


def tables(results: dict[str, dict], speedups: dict[int, dict[str, float]], settings: dict) -> list[Table]:
    first, last = results["none"]["positions"][0], results["none"]["positions"][-1]
    header = ["kv cache", f"step at {first} (ms)", f"step at {last} (ms)", "step slope", "total slope"]
    rows = [[name, fmt(r["step_s"][0] * 1e3), fmt(r["step_s"][-1] * 1e3), f"{r['step_slope']:.2f}",
             f"{r['total_slope']:.2f}"] for name, r in results.items()]
    slopes = Table(f"scaling: {settings['model']}, {settings['dtype']} (slopes: log-log fits of time vs t or n)",
                   header, rows)
    totals = {name: dict(zip(r["n"], r["total_s"])) for name, r in results.items()}
    speed = Table("total time for n tokens (s) and the cache's speed-up over none",
                  ["n", *results, "none/contiguous", "none/paged"],
                  [[str(n), *(fmt(totals[name][n]) for name in results),
                    f"{s['contiguous']:.1f}x", f"{s['paged']:.1f}x"] for n, s in speedups.items()])
    return [slopes, speed] if speedups else [slopes]
