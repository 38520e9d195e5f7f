"""`kvgen eval-ppl`: perplexity of a text under each KV cache policy (table, JSON, plot)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvgen.cache.policies import CachePolicy
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
window and h2o keep absolute positions, so they cannot run past the context)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval-ppl", help="perplexity of a text under each KV cache policy",
                              description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--text", type=Path, help=f"UTF-8 text file (default: the bundled {ppl.BUNDLED_TEXT})")
    p.add_argument("--policy", action="append", required=True, metavar="P",
                   help="full, window:W, sinks:S,W or h2o:H,W (repeatable)")
    p.add_argument("--max-tokens", type=int, help="tokens of the text streamed, BOS included (default: see below)")
    p.add_argument("--plot", type=Path, help="PNG: cumulative perplexity against position")
    p.add_argument("--json", type=Path, help="JSON: every policy's perplexity and per-token NLL")
    add_engine_options(p)
    p.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    policies = [CachePolicy.parse(spec) for spec in args.policy]  # bad input is reported before loading
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
