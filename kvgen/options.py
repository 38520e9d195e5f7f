"""The options every engine command shares, and what they build: `add_engine_options` /
`engine_config` / `build_engine_from_args`, the sampling options, and a model's config read without
its weights. The subcommand modules (kvgen.cli, bench, eval, server, chat) import from here, so none
of them imports another to get them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgen.cache.sizing import parse_bytes
from kvgen.config import (
    ACTIVATION_MODES, ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS, DTYPES, KV_CACHE_DTYPES, KV_CACHE_MODES,
    KV_OFFLOAD_DTYPES, MAX_SPECULATIVE_TOKENS, QUANTIZATION_MODES, SPECULATIVE_METHODS, EngineConfig, ModelConfig,
)
from kvgen.engine.base import Engine
from kvgen.errors import ModelLoadError
from kvgen.llm import open_engine
from kvgen.loaders import load_model
from kvgen.option_space import KV_POLICY_FORMS, refused_pairs_text
from kvgen.sampling_params import SamplingParams


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine", "Any value of one option goes with any of another "
                                  f"except (docs/options.md): {refused_pairs_text()}.")
    g.add_argument("--model", help="HF directory, .gguf, llama2.c .bin, or a Hugging Face repo id: org/name, "
                                   "org/name:Q4_K_M (default: stories260K, or $KVGEN_MODEL)")
    g.add_argument("--gguf-file", help="the .gguf file to use in a GGUF repo or directory given by --model")
    g.add_argument("--tokenizer", help="tokenizer file or directory, if not beside the model")
    g.add_argument("--quantization", choices=QUANTIZATION_MODES, default="auto",
                   help="auto (default): keep a GGUF's quantized weights packed, on kernels that read them so; "
                        "none: dequantize them to --dtype; int8 / int4: pack float weights (groups of 32)")
    g.add_argument("--activations", choices=ACTIVATION_MODES, default=ACTIVATION_MODES[0],
                   help="how packed matmuls quantize x per 32 values: int8x2 (default: two int8 parts, ~15 bits) "
                        "or int8 (one part, as llama.cpp: verify steps and small batches do half the integer work)")
    g.add_argument("--kv-cache", choices=KV_CACHE_MODES, default="paged", help="KV cache kind (default: paged)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, 1..256)")
    g.add_argument("--num-kv-blocks", type=int, help="KV capacity in blocks")
    g.add_argument("--kv-cache-memory", type=_byte_size, help="KV capacity in bytes, e.g. 2GiB or 512MB")
    g.add_argument("--kv-offload-memory", type=_byte_size,
                   help="a host-RAM tier for evicted prefix blocks, e.g. 2GiB (docs/kv-cache.md, tiers)")
    g.add_argument("--kv-cache-dir", help="a disk tier for prefix blocks in this directory, kept across restarts")
    g.add_argument("--kv-cache-disk", type=_byte_size, default=20 * 1024**3,
                   help="the disk tier's budget (default: 20GiB)")
    g.add_argument("--kv-offload-dtype", choices=KV_OFFLOAD_DTYPES, default="auto",
                   help="what the tiers store: auto (the pool's own bytes) or int8 (a float pool's blocks with a "
                        "scale per row, about a quarter of fp32's bytes; docs/kv-cache.md)")
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
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (docs/gpu.md)")
    s = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    s.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   help="ngram: prompt lookup; draft: a smaller model sharing the tokenizer (--draft-model); suffix: a "
                        "suffix tree over the prompt, the output and recent outputs (variable length, up to K); mtp: "
                        "the checkpoint's own MTP layer (Qwen3.5)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help=f"tokens proposed and verified per step, 1..{MAX_SPECULATIVE_TOKENS} (default: 4)")
    s.add_argument("--draft-model", help="the draft checkpoint (the target's own file for self-speculation)")
    s.add_argument("--draft-quantization", choices=QUANTIZATION_MODES, default="auto",
                   help="how the draft's weights are kept (auto: int4 on the CPU, for matrices wider than that)")
    s.add_argument("--draft-p-min", type=float, default=0.75,
                   help="the draft stops proposing after a token it gives less probability than this (0: never)")
    s.add_argument("--draft-vocab-size", type=int, default=32768,
                   help="the draft scores the first this many token ids and the text's own tokens (0: all)")
    s.add_argument("--draft-suffix-match", type=int, default=5,
                   help="a sequence takes suffix decoding's proposal instead of the draft's where the suffix tree "
                        "matches its last this many tokens or more (default: 5; 0: never)")
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
        quantization=args.quantization, activations=args.activations,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_backend=args.distributed_backend, distributed_timeout=args.distributed_timeout,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
        draft_quantization=args.draft_quantization, draft_p_min=args.draft_p_min,
        draft_vocab_size=args.draft_vocab_size, draft_suffix_match=args.draft_suffix_match,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max, adaptive_speculation=not args.no_adaptive_speculation,
        fused_decode=not args.no_fused_decode, enforce_eager=getattr(args, "enforce_eager", False),
        kv_offload_memory=getattr(args, "kv_offload_memory", None), kv_cache_dir=getattr(args, "kv_cache_dir", None),
        kv_cache_disk=getattr(args, "kv_cache_disk", 20 * 1024**3),
        kv_offload_dtype=getattr(args, "kv_offload_dtype", "auto"),
    )


def build_engine_from_args(args: argparse.Namespace) -> Engine:
    config = engine_config(args)
    engine, stats = open_engine(args.model, config, args.tokenizer, args.gguf_file)
    print(stats.summary(), file=sys.stderr)
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
    g.add_argument("--kv-policy", default="full", help=f"{', '.join(KV_POLICY_FORMS)} (bounded ones: paged cache only)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, kv_policy=args.kv_policy,
    )


def config_only(path: Path) -> ModelConfig:
    """The model's config without loading weights where the format allows (HF dir or config.json)."""
    config_file = path / "config.json" if path.is_dir() else path
    if config_file.name.endswith(".json"):
        try:
            return ModelConfig.from_hf(json.loads(config_file.read_text()), config_file)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(config_file, f"cannot read config: {e}") from None
    return load_model(path).config
