"""GGUF files (llama architecture): metadata -> ModelConfig, tensors -> HF weights, vocabulary -> tokenizer.

Two layout details matter:
- GGUF lists a tensor's dimensions fastest-varying first (ne0 = number of columns), the reverse of
  numpy/torch order: a [vocab, hidden] embedding is stored with shape (hidden, vocab).
- llama.cpp's converter permutes q/k rows for interleaved-pair RoPE; `interleaved_to_half` undoes it
  (on raw block rows for matrices, see `gguf_tensors.rotate_half_rows`).

Every tensor is read as a `GGUFWeight` (raw blocks). By default each is dequantized to a float
tensor in `LoadedModel.weights`; with `keep_quantized`, block-quantized matrices stay raw in
`LoadedModel.quantized` instead, for quantized linear layers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders import LoadedModel, check_weights, interleaved_to_half, shard_plan
from kvgen.loaders.gguf_tensors import GGUFWeight, UnsupportedTensorType, read_tensor, rotate_half_rows
from kvgen.loaders.gguf_vocab import gguf_tokenizer, token_id
from kvgen.tokenizer import Tokenizer

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ARCH = "llama"


def load_gguf(
    path: Path,
    *,
    tokenizer: Tokenizer | None,
    device: str | torch.device,
    dtype: torch.dtype,
    keep_quantized: bool = False,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Loads a llama-architecture GGUF; tensors are dequantized to `dtype`, except that with
    `keep_quantized` block-quantized matrices stay raw in `LoadedModel.quantized`."""
    reader = _open(path)
    meta = _metadata(path, reader)
    if meta.get("general.architecture") != _ARCH:
        raise ModelLoadError(path, f"architecture {meta.get('general.architecture')!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(path, meta, tensors)
    if tokenizer is None:  # before the weights: a bad vocabulary is reported without dequantizing first
        tokenizer = gguf_tokenizer(path, meta)
    raw = _read_tensors(path, tensors)
    names = check_weights({name: w.shape for name, w in raw.items()}, config, path)
    raw = _rotate_half_qk({name: raw[name] for name in names}, config)
    plan = shard_plan(config, shard, path)
    if plan is not None:  # slices of the memory-mapped blocks, before anything is dequantized
        raw = {name: plan.take(name, w) for name, w in raw.items()}
    quantized = {n: w for n, w in raw.items() if keep_quantized and _is_quantized_matrix(w)}
    weights = {n: _dequantize(path, w).to(device=device, dtype=dtype) for n, w in raw.items() if n not in quantized}
    return LoadedModel(config, weights, tokenizer, str(path), quantized, shard=plan)


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ModelLoadError(path, f"not a GGUF file, or a truncated or corrupt one: {e}") from None


def _metadata(path: Path, reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field as a Python value (arrays as lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except (ValueError, IndexError) as e:
        raise ModelLoadError(path, f"unreadable GGUF metadata: {e}") from None


def _config(path: Path, meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> ModelConfig:
    """ModelConfig from `llama.*` metadata; biases and tying are read off which tensors exist."""
    p = f"{_ARCH}."
    try:
        hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
        head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
        if int(meta.get(p + "rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("partial rotary embeddings (rope.dimension_count != head dim) are not supported")
        return ModelConfig(
            vocab_size=_vocab_size(meta, tensors),
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_layers=int(meta[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(meta[p + "context_length"]),
            rms_norm_eps=_f32(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=_f32(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta, tensors),
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=token_id(meta, "bos"),
            eos_token_ids=_stop_ids(meta),
        )
    except KeyError as e:
        raise ModelLoadError(path, f"GGUF metadata key {e.args[0]} is missing") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path, f"bad GGUF metadata: {e}") from None


def _vocab_size(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> int:
    """From the token list; without one, from llama.vocab_size or the embedding's row count."""
    if "tokenizer.ggml.tokens" in meta:
        return len(meta["tokenizer.ggml.tokens"])
    if f"{_ARCH}.vocab_size" in meta:
        return int(meta[f"{_ARCH}.vocab_size"])
    return int(tensors["token_embd.weight"].shape[-1])  # GGUF order: (hidden, vocab)


def _rope_scaling(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        raise ValueError("Llama 3.1-style rope_freqs scaling is not supported")
    kind = meta.get(f"{_ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"rope scaling {kind!r} is not supported (linear is)")
    return {"rope_type": "linear", "factor": _f32(meta[f"{_ARCH}.rope.scaling.factor"])}


def _hf_name(path: Path, name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _BLOCK_TENSOR.fullmatch(name)
    if m is None or m.group(2) not in BLOCK_NAMES:
        raise ModelLoadError(path, f"unexpected tensor {name!r} for a llama GGUF")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{BLOCK_NAMES[kind]}.{suffix}"


def _read_tensors(path: Path, tensors: dict[str, ReaderTensor]) -> dict[str, GGUFWeight]:
    """Every tensor, raw, under its HF name."""
    try:
        return {(hf := _hf_name(path, name)): read_tensor(t, hf) for name, t in tensors.items()}
    except UnsupportedTensorType as e:
        raise ModelLoadError(path, str(e)) from None
    except ValueError as e:  # a byte count that does not fit the shape and type: a damaged header
        raise ModelLoadError(path, f"corrupt tensor data: {e}") from None


def _rotate_half_qk(weights: dict[str, GGUFWeight], config: ModelConfig) -> dict[str, GGUFWeight | torch.Tensor]:
    """Undoes llama.cpp's q/k row permutation: on raw rows for the matrices, on values for biases."""
    out: dict[str, GGUFWeight | torch.Tensor] = dict(weights)
    for layer in range(config.num_layers):
        for module, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            prefix = f"model.layers.{layer}.self_attn.{module}"
            out[prefix + ".weight"] = rotate_half_rows(weights[prefix + ".weight"], heads)
            if prefix + ".bias" in weights:
                out[prefix + ".bias"] = interleaved_to_half(weights[prefix + ".bias"].dequantize(), heads)
    return out


def _is_quantized_matrix(weight: GGUFWeight | torch.Tensor) -> bool:
    return isinstance(weight, GGUFWeight) and weight.is_quantized and len(weight.shape) == 2


def _dequantize(path: Path, weight: GGUFWeight | torch.Tensor) -> torch.Tensor:
    """float32 values; a tensor (a bias already permuted) passes through."""
    if isinstance(weight, torch.Tensor):
        return weight
    try:
        return weight.dequantize()
    except ValueError as e:  # block bytes that do not fit the shape: a damaged file
        raise ModelLoadError(path, f"tensor {weight.name}: corrupt data: {e}") from None


def _stop_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """EOS, end-of-turn and end-of-message ids (Llama 3 instruct ends a turn with <|eot_id|>)."""
    ids = (token_id(meta, kind) for kind in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
