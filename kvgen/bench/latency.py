"""`kvgen bench latency`: one request alone (batch 1), P prompt tokens, N new tokens, EOS ignored.

Per run: time to first token, prefill tokens/s (P / TTFT), decode tokens/s over tokens 2..N. Decode at
batch 1 is memory-bound: each token reads every weight once plus the K/V of the tokens so far, so
bytes read per token x tokens/s is compared with the bandwidth of a large copy measured in the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch

from kvgen.bench.system import System, TokenTimes
from kvgen.bench.tasks import task_prompts
from kvgen.bench.report import Metric, Report, comparison_table, median, timed
from kvgen.cache.sizing import format_bytes, kv_bytes_per_token
from kvgen.config import ModelConfig
from kvgen.tokenizer import Tokenizer

METRICS = (
    Metric("ttft_s", "time to first token (ms)", 1e3),
    Metric("prefill_tokens_per_s", "prefill tokens/s"),
    Metric("decode_tokens_per_s", "decode tokens/s"),
    Metric("decode_bytes_per_s", "decode GB/s read (weights + KV)", 1e-9),
    Metric("bandwidth_fraction", "% of memory bandwidth", 100),
)
BANDWIDTH_REPEATS = 5


def run(args: argparse.Namespace, config: ModelConfig, systems: Sequence[System], settings: dict,
        weights: int, tokenizer: Tokenizer | None = None) -> Report:
    """`weights`: the bytes of the matrices kvgen's decode step reads once each (packed or float);
    `tokenizer` renders the prompts of a text task (`--task`, kvgen.bench.tasks)."""
    rng = np.random.default_rng(args.seed)
    # A fresh prompt per run: a repeated one would be served from kvgen's prefix cache.
    task = getattr(args, "task", "random")
    prompts = task_prompts(task, tokenizer, config.vocab_size, args.repeats + 1, args.prompt_len, rng)
    prompt_len = round(median([len(p) for p in prompts[1:]]))
    runs = measure(systems, prompts, args.gen_len)
    bandwidth = memory_bandwidth(args.bandwidth_size, torch.device(args.device))
    element = torch.tensor([], dtype=getattr(torch, settings["dtype"])).element_size()
    kv = average_kv_bytes(config, element, prompt_len, args.gen_len)
    results = {name: summarize(system_runs, weights + kv, bandwidth) for name, system_runs in runs.items()}
    title = (f"latency: {settings['model']}, {settings['dtype']}, batch 1, {task} prompt {prompt_len}, "
             f"{args.gen_len} new tokens, median of {args.repeats}")
    table, ratios = comparison_table(title, METRICS, results)
    copied = format_bytes(args.bandwidth_size, binary=True)
    notes = [f"{args.device} memory bandwidth: {bandwidth / 1e9:.2f} GB/s (copy of {copied}, read + written, best of "
             f"{BANDWIDTH_REPEATS}); a decode step reads {format_bytes(weights)} of weights + {format_bytes(kv)} "
             "of KV on average", *(note for system in systems if (note := system.build_note()))]
    settings = settings | {"prompt_len": prompt_len, "gen_len": args.gen_len, "repeats": args.repeats, "task": task}
    data = {"settings": settings, "memory_bandwidth_bytes_per_s": bandwidth,
            "decode_bytes_per_token": {"weights": weights, "kv_average": kv}, "results": results, "runs": runs,
            "ratios": ratios}
    return Report("latency", data, [table], notes)


def measure(systems: Sequence[System], prompts: Sequence[list[int]], gen_len: int) -> dict[str, list[dict]]:
    """A warm-up on prompts[0] (not reported), then one timed run per remaining prompt. The systems
    take turns on each prompt, so a drift in the machine's speed shows in all of them alike."""
    for system in systems:
        system.generate_timed(prompts[0], gen_len)
    runs: dict[str, list[dict]] = {s.name: [] for s in systems}
    for prompt in prompts[1:]:
        for system in systems:
            runs[system.name].append(run_stats(system.generate_timed(prompt, gen_len), len(prompt)))
    return runs


def run_stats(times: TokenTimes, prompt_len: int) -> dict:
    ttft = times.tokens[0] - times.start
    decode_time = times.tokens[-1] - times.tokens[0]
    return {"ttft_s": ttft, "prefill_tokens_per_s": prompt_len / ttft, "output_tokens": len(times.tokens),
            "decode_tokens_per_s": (len(times.tokens) - 1) / decode_time if decode_time > 0 else None}


def summarize(runs: list[dict], bytes_per_token: int, bandwidth: float) -> dict:
    """Medians over runs, plus the bytes/s that the median decode speed implies."""
    keys = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")
    result = {k: median([r[k] for r in runs]) if all(r[k] is not None for r in runs) else None for k in keys}
    if result["decode_tokens_per_s"] is not None:
        result["decode_bytes_per_s"] = bytes_per_token * result["decode_tokens_per_s"]
        result["bandwidth_fraction"] = result["decode_bytes_per_s"] / bandwidth
    return result


def average_kv_bytes(config: ModelConfig, element_size: int, prompt_len: int, gen_len: int) -> int:
    """K/V bytes a decode step reads on average: step k of N-1 attends P + k tokens, P + N/2 on average."""
    per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, element_size)
    return round(per_token * (prompt_len + gen_len / 2))


def memory_bandwidth(nbytes: int, device: torch.device, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes read + written per second by `dst.copy_(src)` over `nbytes` on `device`, best of `repeats`."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    return 2 * src.nbytes / min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
