"""The `kvgen` command: generate, batch, kv-size here; serve, chat, bench, eval-ppl with their
subsystems (kvgen.commands).

Every command that runs the engine takes the same engine options (kvgen.options.add_engine_options).
Errors a user can cause (bad file, bad parameter, prompt too long) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from pathlib import Path

from kvgen.cache.hybrid import layer_kinds
from kvgen.cache.sizing import KV_ELEMENT_BYTES, format_bytes, kv_bytes_per_token, kv_scale_bytes
from kvgen.cache.shared_kv import SharedKVShape, shared_kv_shape_of
from kvgen.cache.shared_kv import describe as describe_shared
from kvgen.cache.state_sizing import HybridShape, describe, hybrid_shape_of
from kvgen.cache.tiers.sizing import int8_tier_bytes_per_token, tier_tokens
from kvgen.commands import SUBSYSTEM_COMMANDS
from kvgen.config import DTYPES, KV_CACHE_DTYPES, KV_OFFLOAD_DTYPES, ModelConfig
from kvgen.engine.base import Engine
from kvgen.errors import KVGenError
from kvgen.loaders.parameters import describe_parameters, parameter_counts
from kvgen.options import (_byte_size, add_engine_options, add_sampling_options, build_engine_from_args, config_only,
                           sampling_params)
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import RequestOutput

EXIT_USER_ERROR = 2


def result_json(out: RequestOutput) -> dict:
    """The fields `generate --json` and `batch` print for a finished request."""
    m = out.metrics
    decode_time = m.token_times[-1] - m.token_times[0] if len(m.token_times) > 1 else 0.0
    decode_tps = (len(m.token_times) - 1) / decode_time if decode_time > 0 else None
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "ttft_s": m.ttft, "decode_tokens_per_s": decode_tps,
            "speculative": {"proposed": m.spec_proposed, "accepted": m.spec_accepted,
                            "mean_accepted_length": m.spec_mean_accepted_length}}


# -- commands -----------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # a bad parameter is reported before the model is loaded
    if args.show_kv and (args.json or args.kv_cache != "paged"):
        raise KVGenError("--show-kv draws the paged KV cache: it needs --kv-cache paged and no --json")
    engine = build_engine_from_args(args)
    engine.add_request("cli", args.prompt, params)
    if args.show_kv:
        return _generate_showing_kv(engine)
    final = None
    if not args.json:
        print(args.prompt, end="", flush=True)
    while engine.has_unfinished():
        for out in engine.step():
            if not args.json:
                print(out.outputs[0].new_text, end="", flush=True)
            final = out
    if args.json:
        weights = {role: {"kernel": kernel, "bytes": size} for role, (kernel, size) in engine.model.kernels().items()}
        print(json.dumps(result_json(final) | {"weights": weights}))
    else:
        print()
    return 0


def _generate_showing_kv(engine: Engine) -> int:
    """Runs the request under a live picture of the block pool; prints the text at the end."""
    from kvgen.kv_view import KVView

    view, final = KVView(engine), None
    try:
        while engine.has_unfinished():
            final = next((out for out in engine.step() if out.finished), final)
            view.update()
    finally:
        view.close()
    print(final.prompt + final.text)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    requests = _read_batch(Path(args.input))
    engine = build_engine_from_args(args)
    for i, (line, prompt, params) in enumerate(requests):
        try:
            engine.add_request(str(i), prompt, params)
        except KVGenError as e:
            raise KVGenError(f"{args.input}:{line}: {e}") from None
    try:  # before the run, so that an unwritable path does not throw the results away
        out_file = open(args.output, "w")
    except OSError as e:
        raise KVGenError(f"{args.output}: {e.strerror}") from None
    results: dict[str, RequestOutput] = {}
    started = time.monotonic()
    with out_file:
        while engine.has_unfinished():
            results.update((o.request_id, o) for o in engine.step() if o.finished)
        for i in range(len(requests)):
            out_file.write(json.dumps(result_json(results[str(i)])) + "\n")
    tokens = sum(len(o.token_ids) for o in results.values())
    print(f"{len(requests)} requests, {tokens} tokens in {time.monotonic() - started:.2f} s -> {args.output}",
          file=sys.stderr)
    return 0


def _read_batch(path: Path) -> list[tuple[int, str | list[int], SamplingParams]]:
    """One JSON object per line: `prompt` plus SamplingParams fields by name -> (line number, prompt, params)."""
    fields = set(SamplingParams.__dataclass_fields__)
    requests = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise KVGenError(f"{path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = None
        if not isinstance(item, dict) or "prompt" not in item:
            raise KVGenError(f"{path}:{number}: expected a JSON object with a 'prompt'")
        prompt = item.pop("prompt")
        if not isinstance(prompt, (str, list)):
            raise KVGenError(f"{path}:{number}: 'prompt' must be a string or a list of token ids")
        unknown = set(item) - fields
        if unknown:
            raise KVGenError(f"{path}:{number}: unknown fields {sorted(unknown)}")
        try:
            requests.append((number, prompt, SamplingParams(**item)))
        except KVGenError as e:
            raise KVGenError(f"{path}:{number}: {e}") from None
    return requests


def cmd_kv_size(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise KVGenError(f"--tokens must be a positive number of tokens, got {args.tokens}")
    if args.model and (hybrid := hybrid_shape_of(args.model)) is not None:
        return _print_hybrid(hybrid, args)
    if args.model and (shared := shared_kv_shape_of(args.model)) is not None:
        return _print_hybrid(shared, args)
    config = config_only(Path(args.model)) if args.model else _default_config()
    if (hybrid := HybridShape.from_config(config)) is not None:  # a GGUF of a model with recurrent layers
        return _print_hybrid(hybrid, args)
    if (shared := SharedKVShape.from_model_config(config)) is not None:  # a Gemma 4 GGUF
        return _print_hybrid(shared, args)
    dtype = DTYPES[args.dtype] if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    element, scale = KV_ELEMENT_BYTES[dtype], kv_scale_bytes(dtype, config.head_dim)
    per_layer = kv_bytes_per_token(1, config.num_kv_heads, config.head_dim, element, scale)
    per_token = per_layer * config.num_layers
    total = per_token * args.tokens
    report = {"layers": config.num_layers, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
              "dtype": dtype, "bytes_per_element": element, "scale_bytes": scale,
              "bytes_per_token_per_layer": per_layer,
              "bytes_per_token": per_token, "tokens": args.tokens, "bytes_per_layer": per_layer * args.tokens,
              "bytes_total": total}
    tier_per_token = (int8_tier_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim)
                      if args.kv_offload_dtype == "int8" else per_token)
    report["tiers"] = tier_tokens(tier_per_token, args.block_size, args.kv_offload_memory, args.kv_cache_disk)
    if config.is_moe:
        report["parameters_total"], report["parameters_active"] = parameter_counts(config)
    if config.is_hybrid:
        report["kinds"] = _hybrid_kinds(config, per_layer, args.tokens)
        report["bytes_total_hybrid"] = sum(kind["bytes"] for kind in report["kinds"])
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"layers {config.num_layers}, kv_heads {config.num_kv_heads}, head_dim {config.head_dim}, "
          f"{dtype} ({element} bytes" + (f", plus {scale} bytes of float32 scales per token and head: one per 16 "
                                         "dimensions of K, one for V)" if scale else ")"))
    scaled = f"{config.num_kv_heads} x (2 x {config.head_dim} x {element} + {scale})" if scale else \
        f"2 x {config.num_kv_heads} x {config.head_dim} x {element}"
    print(f"per token, per layer: {scaled} = {per_layer:,} bytes")
    print(f"per token, all layers: {per_token:,} bytes ({format_bytes(per_token)})")
    print(f"{args.tokens:,} tokens: {per_layer * args.tokens:,} bytes per layer "
          f"({format_bytes(per_layer * args.tokens)}), {total:,} bytes in all ({format_bytes(total)}, "
          f"{format_bytes(total, binary=True)})")
    for kind in report.get("kinds", []):
        what = "global" if kind["window"] is None else f"window {kind['window']}"
        print(f"hybrid cache, {kind['layers']} {what} layers: {kind['bytes_per_token']:,} bytes per token, "
              f"{kind['tokens_held']:,} tokens held = {kind['bytes']:,} bytes ({format_bytes(kind['bytes'])})")
    if config.is_moe:
        print(describe_parameters(config))
    for tier, row in report["tiers"].items():
        print(f"{tier} tier of {format_bytes(row['bytes'], binary=True)}: {row['tokens']:,} tokens "
              f"({row['blocks']:,} blocks of {args.block_size})")
    if "kinds" in report:
        hybrid = report["bytes_total_hybrid"]
        print(f"hybrid cache in all: {hybrid:,} bytes ({format_bytes(hybrid)}), {hybrid / total:.1%} of every "
              "layer holding every token")
    return 0


def _print_hybrid(shape: HybridShape | SharedKVShape, args: argparse.Namespace) -> int:
    """kv-size for a model with recurrent layers (Qwen3.5: KV bytes per token and state bytes per
    sequence apart, the state fp32 whatever --dtype) or layers sharing K/V (Gemma 4: the holders only)."""
    dtype = DTYPES[args.dtype] if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise KVGenError(f"kv-size: {dtype} KV pools for a model with recurrent layers are not sized yet")
    report = shape.report(args.tokens, KV_ELEMENT_BYTES[dtype]) | {"dtype": dtype}
    lines = describe(report) if isinstance(shape, HybridShape) else describe_shared(report)
    print(json.dumps(report) if args.json else "\n".join(lines))
    return 0


def _hybrid_kinds(config: ModelConfig, per_layer: int, tokens: int) -> list[dict]:
    """What each kind of layer of a hybrid model holds for one sequence of `tokens` tokens (a windowed
    kind: its window, plus up to a block of slack the pool rounds to)."""
    kinds = layer_kinds([config.window(i) for i in range(config.num_layers)])
    return [{"layers": len(k.layers), "window": k.window, "bytes_per_token": per_layer * len(k.layers),
             "tokens_held": min(tokens, k.window or tokens), "bytes": per_layer * len(k.layers) *
             min(tokens, k.window or tokens)} for k in kinds]


def _default_config() -> ModelConfig:
    from kvgen.llm import default_model_path

    return config_only(default_model_path())


# -- wiring -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgen", description="LLM inference with a KV cache you can see into.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed")
    gen.add_argument("--prompt", default="", help="prompt text (empty: start from BOS)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--show-kv", action="store_true",
                     help="draw the KV block pool live in the terminal while generating (paged cache)")
    add_engine_options(gen)
    add_sampling_options(gen)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("batch", help="run a JSONL file of requests through the engine")
    batch.add_argument("--input", required=True, help="JSONL: one {'prompt': ..., sampling fields} per line")
    batch.add_argument("--output", required=True, help="JSONL results, in input order")
    add_engine_options(batch)
    batch.set_defaults(func=cmd_batch)

    size = sub.add_parser("kv-size", help="KV-cache memory arithmetic for a model")
    size.add_argument("model", nargs="?", help="HF directory, config.json, .gguf or .bin (default model if omitted)")
    size.add_argument("--tokens", type=int, default=1, help="number of tokens to size for")
    size.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    size.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="the pools' dtype, int8 / fp8 with "
                      "their scales (default: --dtype)")
    size.add_argument("--json", action="store_true")
    size.add_argument("--block-size", type=int, default=16, help="tokens per block (the tiers' unit)")
    size.add_argument("--kv-offload-memory", type=_byte_size, help="a host tier of this size: tokens it holds")
    size.add_argument("--kv-cache-disk", type=_byte_size, help="a disk tier of this size: tokens it holds")
    size.add_argument("--kv-offload-dtype", choices=KV_OFFLOAD_DTYPES, default="auto",
                      help="what the tiers store: the pool's bytes (auto) or int8 rows with a scale each")
    size.set_defaults(func=cmd_kv_size)

    for register in SUBSYSTEM_COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for the records commands keep (bench JSON)
    try:
        return args.func(args) or 0
    except (KVGenError, ValueError) as e:
        print(f"kvgen: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def console() -> None:
    """The `kvgen` command and `python -m kvgen`: main's status as the process's. Under torchrun, the
    exit handlers run (a tensor-parallel engine's close: STOP to the other ranks, the group left) and
    the process ends without interpreter teardown, as the other ranks do: tearing gloo's threads down
    there sometimes aborts (SIGABRT) after the work is done, which fails the torchrun job
    (kvgen.distributed.worker.exit_now)."""
    status = main()
    from kvgen.distributed.group import torchrun_rank

    if torchrun_rank() is not None:
        from kvgen.distributed.worker import exit_now

        atexit._run_exitfuncs()
        exit_now(status)
    sys.exit(status)


if __name__ == "__main__":
    console()
