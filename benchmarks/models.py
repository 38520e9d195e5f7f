"""Benchmark models: what `--model` names, and the same weights in the form each peer loads.

    smollm2-135m   the SmolLM2-135M architecture with seeded random weights, built on first use and
                   saved as a Hugging Face directory (safetensors + a WordLevel tokenizer.json), so
                   kvgen and every peer read the same files. Benchmarks feed token ids, so random
                   weights and a placeholder vocabulary cost nothing in realism for speed.
    llama-1b       Llama-3.2-1B's shape (hidden 2048, 16 layers, MLP 8192, 32 heads over 8 KV heads,
                   vocabulary 128256, tied embeddings, RoPE base 500000), seeded random weights in bfloat16
    llama-3b       Llama-3.2-3B's shape (hidden 3072, 28 layers, MLP 8192, 24 heads over 8 KV heads)
    qwen35-0.8b    Qwen3.5-0.8B's and -2B's text shapes (24 layers, three Gated DeltaNet layers of 16 key
    qwen35-2b      and 16 value heads of 128 to one gated attention layer of 8 heads over 2 KV heads of
                   256; hidden 1024 / 2048, MLP 3584 / 6144, vocabulary 248320, tied embeddings)
    qwen35-0.8b-mtp  the 0.8B shape with the MTP layer its checkpoint carries (random, as the rest: it
                   guesses nothing right, so what `--speculative-method mtp` costs is what it measures)
    qwen3-30b-a3b  Qwen3-30B-A3B's layer at full width (hidden 2048, 128 experts of 768, top-8, 32 heads
                   over 4 KV heads of 128, vocabulary 151936) with 8 of its 48 layers, which fit this
                   machine beside llama.cpp's copy
    gpt-oss-20b    gpt-oss-20b's layer at full width (hidden 2880, 32 experts of 2880, top-4, 64 heads over 8
                   KV heads of 64, windows of 128 in every other layer, learned sinks, YaRN RoPE, biases,
                   vocabulary 201088) with 8 of its 24 layers; `gpt-oss-20b:MXFP4_MOE` is its published mix
                   (experts MXFP4, the rest Q8_0)
    gemma4-e2b     Gemma 4 E2B's text shape (35 layers of hidden 1536, 8 heads over one KV head of 256 in
                   the window layers (window 512) and 512 in every fifth, global, layer; the last 20
                   layers reading layers 13 and 14's K/V, with MLPs of 12288 against 6144; per-layer
                   inputs of 256) with a 32,768-piece vocabulary: E2B's own 262,144 makes a per-layer
                   table of 2.3G parameters, which this machine cannot draw and convert (the LM head
                   and both tables shrink; the layers are E2B's)
    NAME:MIX       a generated architecture as llama.cpp's own converter and llama-quantize make a GGUF
                   of it, MIX one of QUANT_MIXES (e.g. llama-1b:Q4_K_M); built once, then cached
                   (benchmarks.random_models, benchmarks.llama_tools)
    stories260k    the default model (`kvgen.llm.default_model_path()`); transformers reads the
                   GGUF copy beside it.
    any path       a HF directory, a .gguf, or a llama2.c .bin (peers need a .gguf of the same stem).
                   These two kvgen.bench.bench_model resolves by itself, without this harness.

Conversions for peers (a GGUF for llama.cpp, a plain HF directory for CTranslate2) are cached under
`$KVGEN_CACHE_DIR` (default ~/.cache/kvgen) beside the generated models. The 1B and 3B shapes use no
rope scaling (Llama 3.2's "llama3" scaling becomes a rope_freqs tensor, which kvgen does not read)
and a context of 8192, which is all a bench asks for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.random_models import (QUANT_MIXES, Family, build_atomically, build_quantized_gguf,
                                       build_random_model, family_of, save_placeholder_tokenizer)
from kvgen.bench.bench_model import DEFAULT_WEIGHTS_SEED, BenchModel, resolve_file
from kvgen.paths import cache_root

__all__ = ["ARCHITECTURES", "QUANT_MIXES", "BenchModel", "build_random_model", "gguf_for", "load_hf_model",
           "parse_name", "plain_hf_dir", "resolve", "write_gguf"]

_LLAMA32 = dict(vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
# Qwen3.5's text config as Qwen/Qwen3.5-0.8B and -2B give it, but for the context (8192 is all a bench asks).
_QWEN35 = dict(family=Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen2", ("--no-mtp",)),
               num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
               bos_token_id=151643, eos_token_id=151643, dtype="bfloat16")  # Qwen2's <|endoftext|>
# Gemma 4 E2B's text config as google/gemma-4-E2B gives it, but for the vocabulary (see the docstring)
# and the context.
_GEMMA4_E2B = dict(family=Family("Gemma4TextConfig", "Gemma4ForCausalLM", "placeholder-json"),
                   hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                   num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                   layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, num_kv_shared_layers=20,
                   use_double_wide_mlp=True, hidden_size_per_layer_input=256, vocab_size=32768,
                   vocab_size_per_layer_input=32768, final_logit_softcapping=30.0, tie_word_embeddings=True,
                   max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   dtype="bfloat16")
# Each generated architecture: its family's transformers config fields (LlamaConfig's unless `family`
# names another: benchmarks.random_models.Family).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    ),
    "llama-1b": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3b": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    "qwen35-0.8b": dict(_QWEN35, hidden_size=1024, intermediate_size=3584),
    "qwen35-2b": dict(_QWEN35, hidden_size=2048, intermediate_size=6144),
    "qwen35-0.8b-mtp": dict(_QWEN35, family=Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen2", mtp_layers=1),
                            hidden_size=1024, intermediate_size=3584),
    "gemma4-e2b": _GEMMA4_E2B,
    "qwen3-30b-a3b": dict(
        family=Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen2"), hidden_size=2048, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        dtype="bfloat16"),
    "gpt-oss-20b": dict(
        family=Family("GptOssConfig", "GptOssForCausalLM", "qwen2"), hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 4,
        attention_bias=True, vocab_size=201088, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=8192, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
        dtype="bfloat16"),
}


def resolve(model: str | None, seed: int = DEFAULT_WEIGHTS_SEED) -> BenchModel:
    """`--model` -> BenchModel: a generated architecture's name, NAME:MIX, `stories260k`, a path, or None
    (the default model)."""
    parsed = parse_name(model)
    if parsed is not None:
        name, mix = parsed
        hf = cache_root() / "bench-models" / f"{name}-seed{seed}"
        if not (hf / "config.json").is_file():
            build_atomically(hf, lambda tmp: build_random_model(ARCHITECTURES[name], seed, tmp))
        if mix is None:
            return BenchModel(name, hf)
        family, _ = family_of(ARCHITECTURES[name])
        gguf = build_quantized_gguf(hf, hf.with_name(f"{hf.name}-gguf") / f"{name}-{mix}.gguf", mix, family)
        return BenchModel(model, gguf, gguf)
    return resolve_file(model)


def parse_name(model: str | None) -> tuple[str, str | None] | None:
    """"llama-1b" -> ("llama-1b", None); "llama-1b:q4_k_m" -> ("llama-1b", "Q4_K_M"); None for what names
    no generated architecture (a path, a hub id). A known architecture with an unknown mix is a ValueError."""
    name, _, mix = (model or "").partition(":")
    if name not in ARCHITECTURES:
        return None
    if not mix:
        return name, None
    if mix.upper() not in QUANT_MIXES:
        raise ValueError(f"{model}: unknown quantization mix {mix!r}; the bench makes {', '.join(QUANT_MIXES)}")
    return name, mix.upper()


def hf_source(model: BenchModel) -> tuple[Path, dict[str, Any]]:
    """(directory, extra from_pretrained kwargs) for transformers: a HF directory as it is, anything
    else through a GGUF of the same weights (the model's own, or one written from kvgen's weights)."""
    if model.is_hf_dir:
        return model.path, {}
    gguf = gguf_for(model, "float32")
    return gguf.parent, {"gguf_file": gguf.name}


def load_hf_model(model: BenchModel, dtype: torch.dtype):
    """The model as a transformers causal LM in eval mode, from the same files kvgen reads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, kwargs = hf_source(model)
    config = AutoConfig.from_pretrained(directory, **kwargs)
    config.pad_token_id = None  # GGUF files give -1 (unset), which transformers rejects
    return AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype, **kwargs).eval()


def plain_hf_dir(model: BenchModel) -> Path:
    """A HF directory with safetensors and tokenizer files (what CTranslate2's converter needs)."""
    if model.is_hf_dir:
        return model.path

    def export(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        loaded = load_hf_model(model, torch.float32)
        # transformers will not save a model it read from GGUF; a fresh copy of it, it will.
        fresh = AutoModelForCausalLM.from_config(loaded.config)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(tmp)
        save_placeholder_tokenizer(loaded.config.vocab_size, tmp)  # transformers misreads some GGUF vocabularies

    return converted(model, "hf", export)


def gguf_for(model: BenchModel, dtype: str) -> Path:
    """A GGUF of the model for llama.cpp: the existing one, or one written from kvgen's loaded weights."""
    if model.gguf is not None and dtype == "float32":
        return model.gguf
    return converted(model, f"gguf-{dtype}", lambda tmp: write_gguf(model.path, tmp / "model.gguf", dtype),
                     inner="model.gguf")


def converted(model: BenchModel, kind: str, build: Callable[[Path], None], inner: str = "") -> Path:
    """A cached conversion of `model`, keyed by its path and modification time; built once."""
    stat = model.path.stat()
    key = hashlib.sha1(f"{model.path.resolve()}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    path = cache_root() / "bench-models" / "converted" / f"{model.path.stem}-{key}-{kind}"
    if not path.exists():
        build_atomically(path, build)
    return path / inner if inner else path


# -- GGUF writer (llama architecture) ---------------------------------------------------------------

def write_gguf(source: Path, out: Path, dtype: str = "float32") -> None:
    """Writes a llama-architecture GGUF of any model kvgen loads, the way llama.cpp's converter lays it
    out: llama.cpp tensor names, q/k rows permuted back to interleaved-pair RoPE, norms in F32, and a
    placeholder SentencePiece vocabulary (<unk> <s> </s>, 256 byte tokens, then ▁w<i>)."""
    import gguf

    from kvgen.loaders import load_model

    loaded = load_model(source)
    cfg = loaded.config
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") != "linear":
        raise ValueError(f"GGUF export supports linear RoPE scaling only, not {cfg.rope_scaling}")
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_metadata(writer, cfg)
    _write_vocab(writer, cfg.vocab_size, cfg.bos_token_id, (cfg.eos_token_ids or (None,))[0])
    for name, tensor in loaded.weights.items():
        array, raw_dtype = _gguf_array(_to_interleaved(name, tensor, cfg.num_heads, cfg.num_kv_heads), dtype)
        writer.add_tensor(_gguf_name(name), array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight (kvgen's GGUF reader, inverted)."""
    from kvgen.loaders.gguf_file import GLOBAL_NAMES
    from kvgen.architectures.spec import GGUF_BLOCK_NAMES

    globals_ = {hf: name for name, hf in GLOBAL_NAMES.items()}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    blocks = {hf: name for name, hf in GGUF_BLOCK_NAMES.items()}
    return f"blk.{layer}.{blocks['.'.join(module)]}.{suffix}"


def _gguf_array(tensor: torch.Tensor, dtype: str):
    """(numpy array, raw GGML type or None): matrices in `dtype`; vectors (norms, biases) stay F32,
    as llama.cpp keeps them."""
    import gguf

    if tensor.ndim == 1 or dtype == "float32":
        return tensor.to(torch.float32).numpy(), None
    if dtype == "float16":
        return tensor.to(torch.float16).numpy(), None
    bf16 = gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(tensor.to(torch.float32).numpy(), bf16), bf16


def _write_metadata(writer, cfg) -> None:
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.rope_scaling is not None:
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])


def _write_vocab(writer, vocab_size: int, bos: int | None, eos: int | None) -> None:
    from gguf import TokenType

    special = {0: ("<unk>", TokenType.UNKNOWN), 1: ("<s>", TokenType.CONTROL), 2: ("</s>", TokenType.CONTROL)}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            token, kind = special[i]
        elif 3 <= i < 259:
            token, kind = f"<0x{i - 3:02X}>", TokenType.BYTE
        else:
            token, kind = f"\u2581w{i}", TokenType.NORMAL
        tokens.append(token)
        types.append(kind)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    for add, token_id in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, eos)):
        if token_id is not None:
            add(token_id)


def _to_interleaved(name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (inverse of `interleaved_to_half`)."""
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
    if heads is None:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
