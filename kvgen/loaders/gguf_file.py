"""GGUF files (llama architecture): metadata -> ModelConfig, tensors -> HF weights, vocabulary -> tokenizer.

Two layout details matter:
- GGUF lists a tensor's dimensions fastest-varying first (ne0 = number of columns), the reverse of
  numpy/torch order: a [vocab, hidden] embedding is stored with shape (hidden, vocab).
- llama.cpp's converter permutes q/k rows for interleaved-pair RoPE; `interleaved_to_half` undoes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, TokenType

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders import LoadedModel, finalize_weights, interleaved_to_half
from kvgen.loaders.tokenizers import BPEVocabTokenizer
from kvgen.tokenizer import Tokenizer

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
}
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
) -> LoadedModel:
    """Loads a llama-architecture GGUF: F32/F16/BF16/Q8_0 tensors are dequantized to `dtype`."""
    reader = _open(path)
    meta = _metadata(path, reader)
    if meta.get("general.architecture") != _ARCH:
        raise ModelLoadError(path, f"architecture {meta.get('general.architecture')!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(path, meta, tensors)
    weights = {_hf_name(path, name): _dequantize(path, t) for name, t in tensors.items()}
    weights = _rotate_half_qk(finalize_weights(weights, config, path, device, dtype), config)
    if tokenizer is None:
        tokenizer = _tokenizer(path, meta)
    return LoadedModel(config, weights, tokenizer, str(path))


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
            bos_token_id=_token_id(meta, "bos"),
            eos_token_ids=tuple(i for i in [_token_id(meta, "eos")] if i is not None),
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


def _rotate_half_qk(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Undoes llama.cpp's q/k row permutation (weights and biases); shapes are already validated."""
    for layer in range(config.num_layers):
        for module, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for name in (f"model.layers.{layer}.self_attn.{module}.{kind}" for kind in ("weight", "bias")):
                if name in weights:
                    weights[name] = interleaved_to_half(weights[name], heads)
    return weights


def _dequantize(path: Path, tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as float32 in torch dimension order."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelLoadError(path, f"tensor {tensor.name} is {tensor.tensor_type.name}; kvgen reads {supported}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF dims are fastest-first
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    # F32 comes back as a read-only view of the memory-mapped file.
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _tokenizer(path: Path, meta: dict[str, Any]) -> BPEVocabTokenizer:
    """The SentencePiece-style vocabulary GGUF llama files carry (`tokenizer.ggml.model == "llama"`)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise ModelLoadError(
            path, f"GGUF tokenizer {model!r} is not supported (only 'llama'); pass tokenizer_path=<tokenizer.json>"
        )
    pieces = meta.get("tokenizer.ggml.tokens")
    if not pieces:
        raise ModelLoadError(path, "GGUF has no tokenizer.ggml.tokens vocabulary; pass tokenizer_path")
    types = meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(pieces))
    special = [i for i, t in enumerate(types) if t in (TokenType.UNKNOWN, TokenType.CONTROL)]
    return BPEVocabTokenizer(
        pieces,
        meta.get("tokenizer.ggml.scores", [0.0] * len(pieces)),
        bos_token_id=_token_id(meta, "bos"),
        eos_token_id=_token_id(meta, "eos"),
        unk_token_id=_token_id(meta, "unknown"),
        special_ids=special,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _token_id(meta: dict[str, Any], kind: str) -> int | None:
    """`tokenizer.ggml.{kind}_token_id`, or None when absent or outside the vocabulary (-1 stored as uint32)."""
    token_id = meta.get(f"tokenizer.ggml.{kind}_token_id")
    n_tokens = len(meta.get("tokenizer.ggml.tokens") or ())
    return int(token_id) if token_id is not None and (not n_tokens or token_id < n_tokens) else None


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
