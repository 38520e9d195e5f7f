"""TTFT of a long document prompt: cold, after a restart (the disk tier), and after eviction (the host
tier), with greedy output tokens compared to the cold run's (kvgen.cache.tiers; docs/kv-cache.md). Each
row is printed as soon as it is measured, with the seconds each tier spent (disk: writing through and
reading back), so that a long document's run shows its figures as they come.

    python benchmarks/kv_tiers_ttft.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --tokens 4096

A "restart" is a new engine over the same --kv-cache-dir, as a server stopped and started again would
be; each engine first answers a two-token prompt (its threads and kernels started), then the runs are
timed; one request at a time. Order: cold; the restarted engine (disk tier); then, on it, a filler
prompt of the same length pushes the document out of its pool and the document is asked again (host tier).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvgen import LLM, SamplingParams
from kvgen.bench.report import machine_info, run_info

DATA = Path(__file__).resolve().parents[1] / "kvgen" / "eval" / "data"


def document(llm: LLM, tokens: int, text: str) -> str:
    """About `tokens` tokens of `text` (repeated as needed), cut at a line."""
    out, lines = "", (text * 50).splitlines(keepends=True)
    for line in lines:
        if len(llm.tokenizer.encode(out + line)) > tokens:
            break
        out += line
    return out


def ask(llm: LLM, prompt: str, max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT seconds, output token ids, prompt tokens computed) of one greedy request."""
    before = llm.engine.stats()
    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    after = llm.engine.stats()
    ttft = out.metrics.ttft if out.metrics.ttft is not None else time.perf_counter() - started
    computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (after.prefix_cache_hits - before.prefix_cache_hits)
    return ttft, out.token_ids, computed


def pressure(model: str, prefix_tokens: int, max_tokens: int) -> dict:
    """32 requests over 8 shared prefixes of `prefix_tokens` tokens, round-robin, with a pool that holds 2
    of them: prompt tokens computed and output tok/s with tiers off and with a host tier."""
    texts = [(DATA / name).read_text() for name in ("gpl-3.0.txt", "python-textwrap.txt", "chat.txt", "tinystory.txt")]
    probe = LLM(model, num_kv_blocks=4)
    prefixes = [document(probe, prefix_tokens, texts[i % 4][i * 997:]) for i in range(8)]
    del probe
    prompts = [prefixes[i % 8] + f"\n\nQuestion {i}: summarise the above.\nAnswer:" for i in range(32)]
    blocks = 2 * (-(-(prefix_tokens + 64) // 16)) + 8
    out = {}
    for name, extra in (("tiers off", {}), ("host tier", {"kv_offload_memory": 8 << 30})):
        llm = LLM(model, num_kv_blocks=blocks, max_num_seqs=2, max_num_batched_tokens=512, **extra)
        ask(llm, "Hello", 1)
        before = llm.engine.stats()
        started = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - started
        after = llm.engine.stats()
        computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (after.prefix_cache_hits - before.prefix_cache_hits)
        out[name] = {"computed": computed, "seconds": seconds, "output_tok_s": 32 * max_tokens / seconds,
                     "tokens": [o.token_ids for o in outs]}
        print(f"{name:<10} prompt tokens computed {computed:>8,}  {seconds:7.1f} s  "
              f"{32 * max_tokens / seconds:6.2f} output tok/s", flush=True)
    print(f"computed fell {out['tiers off']['computed'] / out['host tier']['computed']:.1f}x; outputs equal: "
          f"{out['tiers off']['tokens'] == out['host tier']['tokens']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=4096, help="document length in tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-dir", help="the disk tier's directory (default: a fresh temporary one)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--pressure", action="store_true",
                        help="instead: 32 requests over 8 shared prefixes of --tokens tokens, a pool holding 2")
    args = parser.parse_args()
    if args.pressure:
        pressure(args.model, args.tokens, args.max_tokens)
        return
    directory = args.kv_cache_dir or tempfile.mkdtemp(prefix="kvgen-tiers-")
    options = dict(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=args.tokens + 256)
    question = "\n\nQuestion: in one sentence, what is this text about?\nAnswer:"

    probe = LLM(args.model, num_kv_blocks=4, **options)
    doc = document(probe, args.tokens, (DATA / "gpl-3.0.txt").read_text())
    filler = document(probe, args.tokens, (DATA / "python-textwrap.txt").read_text())
    prompt = doc + question
    n = len(probe.tokenizer.encode(prompt))
    del probe
    rows: dict[str, tuple[float, list[int], int]] = {}
    command = shlex.join(["python", "benchmarks/kv_tiers_ttft.py", *sys.argv[1:]])
    report = {"mode": "kv-tiers-ttft", "machine": machine_info(), "run": {**run_info(sys.argv[1:]), "command": command},
              "settings": {"model": args.model, "tokens": args.tokens, "prompt_tokens": n, "max_tokens": args.max_tokens},
              "runs": {}}  # `kvgen bench report` renders it as a section of BENCHMARKS.md (benchmarks/page.py)
    print(f"{args.model}: a {n}-token prompt, {args.max_tokens} greedy tokens; disk tier {directory}")
    print(f"{'run':<24} {'TTFT s':>8} {'vs cold':>8} {'computed':>9} {'tokens equal':>13}  seconds in each tier (this engine)", flush=True)

    def timed(name: str, llm: LLM) -> None:
        """Asks the document, prints the row at once (a long run shows its figures as they come)."""
        rows[name] = ttft, tokens, computed = ask(llm, prompt, args.max_tokens)
        cold_ttft, cold_tokens, _ = rows["cold"]
        tiers = {t: round(r["seconds"], 3) for t, r in llm.engine.stats().kv_tiers}
        print(f"{name:<24} {ttft:>8.3f} {cold_ttft / ttft:>7.1f}x {computed:>9} {str(tokens == cold_tokens):>13}  "
              f"{tiers}", flush=True)
        report["runs"][name] = {"ttft_s": ttft, "speedup": cold_ttft / ttft, "computed": computed,
                                "equal": tokens == cold_tokens, "tier_seconds": tiers}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    # A pool that holds the document but not the document and the filler. The disk tier is written
    # through as the cold run computes its blocks; a new engine over the same directory is the restart.
    blocks = -(-(n + 256) // 16) + 4
    first = LLM(args.model, kv_cache_dir=directory, num_kv_blocks=blocks, **options)
    ask(first, "Hello", 1)  # a warm engine: thread pools and kernels started, as on a server that has served
    timed("cold", first)
    del first
    restarted = LLM(args.model, kv_offload_memory=4 << 30, kv_cache_dir=directory, num_kv_blocks=blocks, **options)
    ask(restarted, "Hello", 1)
    timed("disk (after restart)", restarted)  # the pool is empty, the disk holds the document
    ask(restarted, filler + question, 1)  # pushes the document out of the pool, into RAM
    timed("host (after eviction)", restarted)
    if not args.kv_cache_dir:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
