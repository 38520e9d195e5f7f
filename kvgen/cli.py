"""The `kvgen` command: generate, batch, serve, bench, eval-ppl, kv-size.

Every command that runs the engine takes the same engine options (see `add_engine_options`).
Errors a user can cause (bad file, bad parameter, prompt too long) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvgen.cache.hybrid import layer_kinds
from kvgen.cache.sizing import KV_ELEMENT_BYTES, KV_SCALE_BYTES, format_bytes, kv_bytes_per_token, parse_bytes
from kvgen.config import (
    ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS, DTYPES, KV_CACHE_DTYPES, KV_CACHE_MODES, MAX_SPECULATIVE_TOKENS,
    QUANTIZATION_MODES, SPECULATIVE_METHODS, EngineConfig, ModelConfig,
)
from kvgen.engine.base import Engine
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.sequence import RequestOutput
from kvgen.errors import KVGenError, ModelLoadError

EXIT_USER_ERROR = 2


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", help="HF directory, .gguf, llama2.c .bin, or a Hugging Face repo id: org/name, "
                                   "org/name:Q4_K_M (default: stories260K, or $KVGEN_MODEL)")
    g.add_argument("--gguf-file", help="the .gguf file to use in a GGUF repo or directory given by --model")
    g.add_argument("--tokenizer", help="tokenizer file or directory, if not beside the model")
    g.add_argument("--quantization", choices=QUANTIZATION_MODES, default="auto",
                   help="auto (default): keep a GGUF's quantized weights packed, on kernels that read them so; "
                        "none: dequantize them to --dtype; int8 / int4: pack float weights (groups of 32)")
    g.add_argument("--kv-cache", choices=KV_CACHE_MODES, default="paged", help="KV cache kind (default: paged)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, 1..256)")
    g.add_argument("--num-kv-blocks", type=int, help="KV capacity in blocks")
    g.add_argument("--kv-cache-memory", type=_byte_size, help="KV capacity in bytes, e.g. 2GiB or 512MB")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV pools store: auto (the model's dtype), a float type, or int8 / fp8 (e4m3) "
                        "with one scale per token and KV head")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="paged decode attention: native (compiled CPU kernel, reads blocks in place), "
                        "sdpa (gathered copy + torch SDPA), auto (native where it builds; default)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model across N processes (Megatron tensor parallelism on torch.distributed); "
                        "kvgen starts N-1 workers, or joins the group torchrun started (docs/tensor_parallel.md)")
    g.add_argument("--distributed-backend", choices=DISTRIBUTED_BACKENDS, default="auto",
                   help="torch.distributed backend: auto (gloo on the CPU, nccl on CUDA; default)")
    g.add_argument("--distributed-timeout", type=float, default=30.0,
                   help="seconds a collective waits for a peer before the run fails (default: 30)")
    g.add_argument("--no-fused-decode", action="store_true",
                   help="run decode steps layer by layer from Python (default: one list of C kernel calls where "
                        "every piece of the step has a kernel; the same results)")
    s = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    s.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   help="ngram: prompt lookup; draft: a smaller model sharing the tokenizer (--draft-model)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help=f"tokens proposed and verified per step, 1..{MAX_SPECULATIVE_TOKENS} (default: 4)")
    s.add_argument("--draft-model", help="the draft checkpoint (the target's own file for self-speculation)")
    s.add_argument("--draft-quantization", choices=QUANTIZATION_MODES, default="auto",
                   help="how the draft's weights are kept (int4: a 4-bit copy of a float checkpoint)")
    s.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram prompt lookup matches")
    s.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram prompt lookup matches")
    s.add_argument("--no-adaptive-speculation", action="store_true",
                   help="speculate at every batch size (default: skip it where it measures slower)")


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        kv_cache=args.kv_cache, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        distributed_backend=args.distributed_backend, distributed_timeout=args.distributed_timeout,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
        draft_quantization=args.draft_quantization, prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max, adaptive_speculation=not args.no_adaptive_speculation,
        fused_decode=not args.no_fused_decode,
    )


def build_engine_from_args(args: argparse.Namespace) -> Engine:
    from kvgen.llm import build_engine, load

    config = engine_config(args)
    engine = build_engine(load(args.model, config, args.tokenizer, args.gguf_file), config)
    if hasattr(engine, "capacity_report"):
        print(engine.capacity_report(), file=sys.stderr)
    return engine


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--kv-policy", default="full", help="full, window:W, sinks:S,W or h2o:H,W (paged cache only)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, kv_policy=args.kv_policy,
    )


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
    config = _config_only(Path(args.model)) if args.model else _default_config()
    dtype = DTYPES[args.dtype] if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    element, scale = KV_ELEMENT_BYTES[dtype], KV_SCALE_BYTES.get(dtype, 0)
    per_layer = kv_bytes_per_token(1, config.num_kv_heads, config.head_dim, element, scale)
    per_token = per_layer * config.num_layers
    total = per_token * args.tokens
    report = {"layers": config.num_layers, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
              "dtype": dtype, "bytes_per_element": element, "scale_bytes": scale,
              "bytes_per_token_per_layer": per_layer,
              "bytes_per_token": per_token, "tokens": args.tokens, "bytes_per_layer": per_layer * args.tokens,
              "bytes_total": total}
    if config.is_hybrid:
        report["kinds"] = _hybrid_kinds(config, per_layer, args.tokens)
        report["bytes_total_hybrid"] = sum(kind["bytes"] for kind in report["kinds"])
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"layers {config.num_layers}, kv_heads {config.num_kv_heads}, head_dim {config.head_dim}, "
          f"{dtype} ({element} bytes" + (f", plus a {scale}-byte scale per token and head)" if scale else ")"))
    scaled = f"({config.head_dim} x {element} + {scale})" if scale else f"{config.head_dim} x {element}"
    print(f"per token, per layer: 2 x {config.num_kv_heads} x {scaled} = {per_layer:,} bytes")
    print(f"per token, all layers: {per_token:,} bytes ({format_bytes(per_token)})")
    print(f"{args.tokens:,} tokens: {per_layer * args.tokens:,} bytes per layer "
          f"({format_bytes(per_layer * args.tokens)}), {total:,} bytes in all ({format_bytes(total)}, "
          f"{format_bytes(total, binary=True)})")
    for kind in report.get("kinds", []):
        what = "global" if kind["window"] is None else f"window {kind['window']}"
        print(f"hybrid cache, {kind['layers']} {what} layers: {kind['bytes_per_token']:,} bytes per token, "
              f"{kind['tokens_held']:,} tokens held = {kind['bytes']:,} bytes ({format_bytes(kind['bytes'])})")
    if "kinds" in report:
        hybrid = report["bytes_total_hybrid"]
        print(f"hybrid cache in all: {hybrid:,} bytes ({format_bytes(hybrid)}), {hybrid / total:.1%} of every "
              "layer holding every token")
    return 0


def _hybrid_kinds(config: ModelConfig, per_layer: int, tokens: int) -> list[dict]:
    """What each kind of layer of a hybrid model holds for one sequence of `tokens` tokens (a windowed
    kind: its window, plus up to a block of slack the pool rounds to)."""
    kinds = layer_kinds([config.window(i) for i in range(config.num_layers)])
    return [{"layers": len(k.layers), "window": k.window, "bytes_per_token": per_layer * len(k.layers),
             "tokens_held": min(tokens, k.window or tokens), "bytes": per_layer * len(k.layers) *
             min(tokens, k.window or tokens)} for k in kinds]


def _config_only(path: Path) -> ModelConfig:
    """The model's config without loading weights where the format allows (HF dir or config.json)."""
    config_file = path / "config.json" if path.is_dir() else path
    if config_file.name.endswith(".json"):
        try:
            return ModelConfig.from_hf(json.loads(config_file.read_text()), config_file)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(config_file, f"cannot read config: {e}") from None
    from kvgen.loaders import load_model

    return load_model(path).config


def _default_config() -> ModelConfig:
    from kvgen.llm import default_model_path

    return _config_only(default_model_path())


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
    size.set_defaults(func=cmd_kv_size)

    for register in _subsystem_commands():
        register(sub, add_engine_options)
    return parser


def _subsystem_commands() -> list[Callable]:
    """Commands that live with their subsystem; imported here, late, because they build on this module."""
    from kvgen.bench.cli import register as register_bench
    from kvgen.eval.cli import register as register_eval
    from kvgen.server.cli import register as register_serve

    return [register_serve, register_bench, register_eval]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (KVGenError, ValueError) as e:
        print(f"kvgen: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
