"""`kvgen bench latency`: one request alone (batch 1), P prompt tokens, N new tokens, EOS ignored.

Per run: time to first token, prefill tokens/s (P / TTFT), decode tokens/s over tokens 2..N.

The roofline: decode at batch 1 is memory-bound, each step reading every matmul's weights once (the
output head included; the embedding only for the rows it looks up; of a mixture's experts, the top-k
a token is routed to) plus the K/V of the tokens so far.
Each system's bytes per step are its own: kvgen's packed matrices as its kernels hold them and its
KV dtype; llama.cpp's matrices as the GGUF file stores them and its F16 KV cache. Bytes per step x
steps/s, against the bandwidth of a streaming read over a buffer far larger than the last-level cache
measured in the same run, says how close a decode step runs to the memory's limit.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvgen.bench.system import System, TokenTimes
from kvgen.bench.tasks import task_prompts
from kvgen.bench.report import Metric, Report, comparison_table, median, timed
from kvgen.cache.sizing import format_bytes, kv_bytes_per_token_of, parse_bytes
from kvgen.config import ModelConfig
from kvgen.tokenizer import Tokenizer

METRICS = (
    Metric("load_s", "load time (s)"),
    Metric("ttft_s", "time to first token (ms)", 1e3),
    Metric("bytes_per_token", "MB read per decode step", 1e-6),
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
    context = prompt_len + args.gen_len / 2
    kv_dtype = settings.get("engine", {}).get("kv_cache_dtype", "auto")
    ours = step_bytes(weights, config, kv_dtype if kv_dtype != "auto" else settings["dtype"], context)
    per_system = {s.name: ours if (own := s.weight_bytes()) is None else step_bytes(own, config, s.kv_dtype, context)
                  for s in systems}
    results = {s.name: summarize(runs[s.name], per_system[s.name], bandwidth) | {"load_s": s.load_s} for s in systems}
    title = (f"latency: {settings['model']}, {settings['dtype']}, batch 1, {task} prompt {prompt_len}, "
             f"{args.gen_len} new tokens, median of {args.repeats}")
    table, ratios = comparison_table(title, METRICS, results)
    llc = last_level_cache()
    notes = [f"{args.device} memory bandwidth: {bandwidth / 1e9:.2f} GB/s (streaming read of "
             f"{format_bytes(args.bandwidth_size, binary=True)}, best of {BANDWIDTH_REPEATS}; last-level cache "
             f"{format_bytes(llc, binary=True) if llc else 'unknown'})",
             *(roofline_note(name, per_system[name], results[name]) for name in results),
             *([load_note(settings["kvgen_load"])] if "kvgen_load" in settings else []),
             *(note for system in systems if (note := system.build_note()))]
    settings = settings | {"prompt_len": prompt_len, "gen_len": args.gen_len, "repeats": args.repeats, "task": task}
    data = {"settings": settings, "memory_bandwidth_bytes_per_s": bandwidth, "memory_bandwidth_method": "read",
            "last_level_cache_bytes": llc, "decode_bytes_per_token": ours, "decode_bytes_per_token_by_system": per_system,
            "results": results, "runs": runs, "ratios": ratios}
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


def summarize(runs: list[dict], step: dict[str, int], bandwidth: float) -> dict:
    """Medians over runs, plus the bytes/s that the median decode speed implies (`step`: step_bytes)."""
    keys = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")
    result = {k: median([r[k] for r in runs]) if all(r[k] is not None for r in runs) else None for k in keys}
    result["bytes_per_token"] = step["weights"] + step["kv_average"]
    if result["decode_tokens_per_s"] is not None:
        result["decode_bytes_per_s"] = result["bytes_per_token"] * result["decode_tokens_per_s"]
        result["bandwidth_fraction"] = result["decode_bytes_per_s"] / bandwidth
    return result


def roofline_note(name: str, step: dict[str, int], result: dict) -> str:
    """One system's bytes per decode step, and the rate and share of the bandwidth they reached."""
    note = (f"{name}: a decode step reads {format_bytes(step['weights'])} of weights + "
            f"{format_bytes(step['kv_average'])} of KV on average")
    if result.get("decode_bytes_per_s") is None:
        return note
    return note + (f": {result['decode_bytes_per_s'] / 1e9:.1f} GB/s at the median decode speed, "
                   f"{result['bandwidth_fraction']:.0%} of the measured bandwidth")


def load_note(load: dict) -> str:
    """kvgen's load time and what it left resident, against the model file plus the KV cache (whose
    pool is reserved at load and takes memory as tokens are written: kvgen.loaders.residency)."""
    note = f"kvgen load: {load['seconds']:.2f} s, peak RSS {format_bytes(load['peak_rss_bytes'])}"
    if load.get("rss_bytes") and load.get("file_bytes") and load.get("kv_cache_bytes"):
        base = load["file_bytes"] + load["kv_cache_bytes"]
        note += (f", RSS after load {format_bytes(load['rss_bytes'])} = {load['rss_bytes'] / base:.2f}x the file "
                 f"({format_bytes(load['file_bytes'])}) + KV cache ({format_bytes(load['kv_cache_bytes'])}, "
                 "its pages taken as tokens are written)")
    return note


def step_bytes(weights: int, config: ModelConfig, kv_dtype: str, context: float) -> dict[str, int]:
    """{"weights", "kv_average"}: what one decode step reads, `context` tokens of K/V in `kv_dtype`
    (a pool dtype as --kv-cache-dtype names it). Step k of N-1 attends P + k tokens: P + N/2 on average."""
    per_token = kv_bytes_per_token_of(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)
    return {"weights": weights, "kv_average": round(per_token * context)}


def gguf_matmul_bytes(path: str | Path) -> int:
    """The bytes of a GGUF's matrices that a decode step reads whole, as the file stores them: every 2-D
    tensor but the token embedding (looked up by row), which counts only where it is also the output
    head (no output.weight: tied); of a mixture's 3-D expert stacks, the share of the experts a token
    uses (`expert_used_count` of `expert_count`)."""
    from kvgen.loaders.gguf_reader import read_gguf

    gguf = read_gguf(path)
    tensors = {t.name: t for t in gguf.tensors}
    tied = "output.weight" not in tensors
    arch = gguf.metadata.get("general.architecture")
    used, count = gguf.metadata.get(f"{arch}.expert_used_count", 0), gguf.metadata.get(f"{arch}.expert_count", 0)
    dense = sum(t.data.nbytes for name, t in tensors.items()
                if len(t.shape) == 2 and (name != "token_embd.weight" or tied))
    experts = sum(t.data.nbytes for t in tensors.values() if len(t.shape) == 3)
    return dense + (experts * used // count if count else 0)


def last_level_cache() -> int | None:
    """The largest CPU cache's size in bytes (sysfs), or None where it is not reported."""
    sizes = []
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        try:
            sizes.append(parse_bytes(text.replace("K", "KiB").replace("M", "MiB")))
        except ValueError:
            continue
    return max(sizes, default=None)


def memory_bandwidth(nbytes: int, device: torch.device, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes read per second by a sum over `nbytes` of float32 on `device` (every thread torch runs),
    best of `repeats`: what a decode step that streams its weights can reach at most."""
    buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)  # first touch: not bandwidth
    return buffer.nbytes / min(timed(lambda: buffer.sum(), device) for _ in range(repeats))
