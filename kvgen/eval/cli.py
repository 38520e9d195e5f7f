"""`kvgen eval-ppl`: perplexity of a text under each KV cache policy (table, JSON, plot)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvgen.bench.report import pyplot
from kvgen.cache.kv_dtype import resolve_kv_dtype
from kvgen.cache.policies import CachePolicy
from kvgen.config import KV_CACHE_DTYPES, QUANTIZATION_MODES
from kvgen.errors import KVGenError
from kvgen.eval import ppl
from kvgen.llm import build_engine, default_model_path, load
from kvgen.options import add_engine_options, engine_config

DESCRIPTION = """\
Streams a text through the engine one token per step under each --policy and reports the
perplexity of every next token, computed from exactly the K/V the policy keeps."""

EPILOG = """\
The engine always runs with --max-num-batched-tokens 1 and prefix caching off, whatever is given:
one token per step is what makes each token see only the K/V its policy kept, and tokens served
from the prefix cache would not be scored. Every policy scores the same tokens: by default the
whole text, cut to the model's context minus 1 when a policy other than sinks is run (full,
window and h2o keep absolute positions, so they cannot run past the context).

With --text-set, several --text or --tokens, it measures what a quantized KV pool costs instead:
for each --quantizations weights setting and each --kv-cache-dtypes pool (float32 always added as
the reference), every text is streamed once to its longest --tokens length under one policy (full
by default), and the table gives each text x length x weights x KV dtype its perplexity and its
change against the same weights' float32 pool. A shorter length is the first tokens of the same
stream, which is exactly what streaming only those tokens gives.

    kvgen eval-ppl --model M.gguf --text-set --tokens 500,2000"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval-ppl", help="perplexity of a text under each KV cache policy",
                              description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--text", type=Path, action="append",
                   help=f"UTF-8 text file (default: the bundled {ppl.BUNDLED_TEXT}; repeatable: a KV dtype sweep)")
    p.add_argument("--text-set", action="store_true",
                   help=f"a KV dtype sweep over the bundled prose, code and chat texts ({', '.join(ppl.TEXT_SET)})")
    p.add_argument("--tokens", metavar="N,N", help="a KV dtype sweep at these lengths, BOS included (default 500,2000)")
    p.add_argument("--kv-cache-dtypes", default="auto,int8,fp8", metavar="D,D",
                   help="the sweep's KV pool dtypes (default auto,int8,fp8; float32 is always run as the reference)")
    p.add_argument("--quantizations", default="auto,none", metavar="Q,Q",
                   help="the sweep's weights settings, as --quantization (default auto,none: packed and dequantized)")
    p.add_argument("--policy", action="append", metavar="P",
                   help="full, window:W, sinks:S,W or h2o:H,W (repeatable; required except in a sweep, which runs one)")
    p.add_argument("--max-tokens", type=int, help="tokens of the text streamed, BOS included (default: see below)")
    p.add_argument("--plot", type=Path, help="PNG: cumulative perplexity against position")
    p.add_argument("--json", type=Path, help="JSON: every policy's perplexity and per-token NLL")
    add_engine_options(p)
    p.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    if args.text_set or args.tokens is not None or len(args.text or []) > 1:
        return cmd_sweep(args)
    if not args.policy:
        raise KVGenError("eval-ppl: give at least one --policy (or a KV dtype sweep: --text-set, --tokens)")
    args.text = args.text[0] if args.text else None
    policies = [CachePolicy.parse(spec) for spec in args.policy]  # bad input is reported before loading
    if args.plot:
        pyplot()  # so is a --plot that cannot be drawn (no matplotlib)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise KVGenError(f"--max-tokens must be at least 2 (BOS and one token to score), got {args.max_tokens}")
    if args.kv_cache != "paged":
        raise KVGenError("eval-ppl runs on the paged engine, where the cache policies live: drop --kv-cache")
    text_name = str(args.text or ppl.BUNDLED_TEXT)
    text = ppl.read_text(args.text)
    model = Path(args.model) if args.model else default_model_path()
    config = ppl.streaming_config(engine_config(args))
    engine = build_engine(load(model, config, args.tokenizer, args.gguf_file), config)
    token_ids = ppl.text_token_ids(engine.tokenizer, text)
    length = _length(args.max_tokens, len(token_ids), policies, engine.max_model_len)
    if length < 2:
        raise KVGenError(f"{text_name}: the text has no token to score after BOS")
    results = ppl.evaluate(engine, token_ids[:length], args.policy)
    print(ppl.table(results, length))
    if args.json:
        settings = {"model": str(model), "text": text_name, "text_tokens": len(token_ids), "tokens_streamed": length,
                    "dtype": args.dtype, "kv_cache_dtype": engine.config.kv_dtype}
        ppl.write_json(args.json, results, settings)
    if args.plot:
        ppl.plot(args.plot, results, f"{model.name} on {Path(text_name).name}: {length} tokens, one per step")
    return 0


def _length(max_tokens: int | None, num_tokens: int, policies: list[CachePolicy], max_model_len: int) -> int:
    """Tokens to stream: --max-tokens (checked against the context), or the default length with a
    note on stderr when that cuts the text."""
    if max_tokens is None:
        length = ppl.default_length(num_tokens, policies, max_model_len)
        if length < num_tokens:
            print(f"note: scoring the first {length} of the text's {num_tokens} tokens: full, window and h2o keep "
                  f"absolute positions, bounded by the model's context of {max_model_len} (--max-tokens sets "
                  "the length)", file=sys.stderr)
        return length
    length = min(max_tokens, num_tokens)
    bounded = [p.spec for p in policies if not p.uses_cache_positions]
    if bounded and length > max_model_len - 1:
        raise KVGenError(f"--max-tokens {max_tokens}: at most {max_model_len - 1} tokens fit the model's context "
                         f"of {max_model_len} (one more is sampled) under {', '.join(bounded)}, which keep "
                         "absolute positions")
    return length


def _csv(value: str, option: str, choices: tuple[str, ...] | None = None) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    bad = [item for item in items if choices is not None and item not in choices]
    if not items or bad:
        raise KVGenError(f"{option} {value}: expected a comma-separated list"
                         + (f" of {', '.join(choices)}" if choices else ""))
    return list(dict.fromkeys(items))


def _lengths(value: str | None) -> list[int]:
    try:
        lengths = sorted({int(n) for n in _csv(value or "500,2000", "--tokens")})
    except ValueError:
        raise KVGenError(f"--tokens {value}: expected comma-separated token counts such as 500,2000") from None
    if lengths[0] < 2:
        raise KVGenError(f"--tokens {value}: each length must be at least 2 (BOS and one token to score)")
    return lengths


def cmd_sweep(args: argparse.Namespace) -> int:
    """text x length x weights x KV dtype: perplexity and change against the same weights' float32 pool."""
    if args.max_tokens is not None or args.plot:
        raise KVGenError("a KV dtype sweep takes --tokens, not --max-tokens, and draws no --plot")
    if args.kv_cache != "paged":
        raise KVGenError("eval-ppl runs on the paged engine, where the cache policies live: drop --kv-cache")
    if len(args.policy or []) > 1:
        raise KVGenError("a KV dtype sweep runs one --policy (default full)")
    policy = CachePolicy.parse((args.policy or ["full"])[0])
    lengths = _lengths(args.tokens)
    kv_dtypes = _csv(args.kv_cache_dtypes, "--kv-cache-dtypes", KV_CACHE_DTYPES)
    weights = _csv(args.quantizations, "--quantizations", QUANTIZATION_MODES)
    texts = [(name, ppl.bundled_text(name)) for name in (ppl.TEXT_SET if args.text_set else ())]
    texts += [(str(path), ppl.read_text(path)) for path in args.text or ()]
    model = Path(args.model) if args.model else default_model_path()
    base = ppl.streaming_config(engine_config(args))
    rows: list[ppl.SweepRow] = []
    for quantization in weights:
        nll: dict[tuple[str, str], list[float]] = {}  # (pool dtype, text) -> NLL of the longest stream
        pools: list[str] = []
        for kv_cache_dtype in ["float32", *kv_dtypes]:
            config = dataclasses.replace(base, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
            loaded = load(model, config, args.tokenizer, args.gguf_file)
            config = resolve_kv_dtype(loaded, config)  # auto: float32 under an fp32 model, 16-bit on packed weights
            if config.kv_dtype in pools:  # run each pool dtype once
                continue
            pools.append(config.kv_dtype)
            engine = build_engine(loaded, config)
            del loaded
            for name, text in texts:
                token_ids = ppl.text_token_ids(engine.tokenizer, text)
                length = min(lengths[-1], len(token_ids))
                if not policy.uses_cache_positions:
                    length = min(length, engine.max_model_len - 1)
                if length < lengths[-1] and kv_cache_dtype == "float32" and quantization == weights[0]:
                    print(f"note: {name} streams {length} tokens, fewer than --tokens asks", file=sys.stderr)
                if length < 2:
                    raise KVGenError(f"{name}: the text has no token to score after BOS")
                nll[config.kv_dtype, name] = ppl.evaluate(engine, token_ids[:length], [policy.spec])[0].nll
            del engine
        for name, _ in texts:
            reference = nll["float32", name]
            for n in lengths:
                if n - 1 > len(reference):
                    continue
                ref = ppl.prefix_perplexity(reference, n)
                rows += [ppl.SweepRow(Path(name).name, n, quantization, pool, ppl.prefix_perplexity(nll[pool, name], n),
                                      ref) for pool in pools]
    rows.sort(key=lambda r: ([Path(t).name for t, _ in texts].index(r.text), r.tokens, weights.index(r.weights)))
    print(ppl.sweep_table(rows))
    if args.json:
        settings = {"model": str(model), "policy": policy.spec, "dtype": args.dtype, "tokens": lengths,
                    "texts": [name for name, _ in texts]}
        ppl.write_sweep_json(args.json, rows, settings, args.argv)
    return 0
