"""GGUF files: metadata -> ModelConfig, tensors -> HF weights, vocabulary -> tokenizer.

Architectures: those of kvgen.architectures (`llama`, `qwen2`, `qwen3`, `phi3`, `gemma3`, `gemma4`); their
metadata keys are prefixed by the name, their tensor names mapped to HF's by the description. Layout details that matter:
- GGUF lists a tensor's dimensions fastest-varying first (ne0 = number of columns), the reverse of
  numpy/torch order: a [vocab, hidden] embedding is stored with shape (hidden, vocab).
- For `llama` (`gguf_interleaved_rope`), llama.cpp's converter permutes q/k rows for interleaved-pair RoPE;
  `interleaved_to_half` undoes it (on raw block rows for matrices, see
  `gguf_tensors.rotate_half_rows`). The others use rotate-half RoPE and are stored as HF has them.
- Gemma's norm weights are stored as 1 + w, the factor kvgen's norms take (kvgen.loaders.hf adds the
  1 for HF checkpoints). What its metadata leaves out, kvgen.architectures.gemma3 fills in as
  llama.cpp does.

Every tensor is read as a `GGUFWeight` (raw blocks). By default each is dequantized to a float
tensor in `LoadedModel.weights`; with `keep_quantized`, block-quantized matrices stay raw in
`LoadedModel.quantized` instead, for quantized linear layers.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvgen.architectures import BY_GGUF_NAME, known_names
from kvgen.architectures.spec import Architecture, float32_value
from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders.rope_layout import interleaved_to_half
from kvgen.loaders.weights import LoadedModel, check_weights, shard_plan
from kvgen.loaders.gguf_reader import GGUFFile, ReaderTensor, read_gguf
from kvgen.loaders.gguf_tensors import GGUFWeight, UnsupportedTensorType, read_tensor, rotate_half_rows
from kvgen.loaders.gguf_vocab import gguf_tokenizer, stop_token_ids, token_id
from kvgen.tokenizer import Tokenizer

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",  # Gemma 4's per-layer inputs
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# The nextn tensors of llama.cpp's MTP layer by HF's names (transformers' Qwen3.5 `mtp.*`).
NEXTN_NAMES = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}
ROPE_FREQS = "rope_freqs.weight"  # read into the config (`_rope_scaling`), not a weight
UNROTATED = 1e20  # a rope_freqs factor at least this large stops its pair (llama.cpp's converter writes 1e30)
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")


def load_gguf(
    path: Path,
    *,
    tokenizer: Tokenizer | None,
    device: str | torch.device,
    dtype: torch.dtype,
    keep_quantized: bool = False,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Loads a GGUF of a known architecture; tensors are dequantized to `dtype`, except that with
    `keep_quantized` block-quantized matrices stay raw in `LoadedModel.quantized`."""
    reader = _open(path)
    meta = _metadata(path, reader)
    arch = BY_GGUF_NAME.get(meta.get("general.architecture"))
    if arch is None:
        raise ModelLoadError(path, f"architecture {meta.get('general.architecture')!r} is not supported "
                                   f"(kvgen runs: {known_names()})")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(path, arch, meta, tensors)
    if tokenizer is None:  # before the weights: a bad vocabulary is reported without dequantizing first
        tokenizer = gguf_tokenizer(path, meta, arch.name)
    mtp = _mtp_tensors(path, arch, {name: tensors.pop(name) for name in _mtp_names(tensors, config)}, config)
    raw = _read_tensors(path, arch, tensors)
    names = check_weights({name: w.shape for name, w in raw.items()}, config, path)
    raw = {name: raw[name] for name in names}
    if arch.gguf_interleaved_rope:
        raw = _rotate_half_qk(raw, config)
    plan = shard_plan(config, shard, path)
    if plan is not None:  # slices of the memory-mapped blocks, before anything is dequantized
        raw = {name: plan.take(name, w) for name, w in raw.items()}
    quantized = {n: w for n, w in raw.items() if keep_quantized and _is_quantized_matrix(w)}
    weights = {n: _dequantize(path, w).to(device=device, dtype=dtype) for n, w in raw.items() if n not in quantized}
    mtp = {n: w if keep_quantized and _is_quantized_matrix(w) else _dequantize(path, w).to(device=device, dtype=dtype)
           for n, w in mtp.items()} if plan is None else {}
    return LoadedModel(config, weights, tokenizer, str(path), quantized, shard=plan, mtp=mtp)


def _mtp_names(tensors: dict[str, ReaderTensor], config: ModelConfig) -> list[str]:
    """The tensors of the multi-token-prediction layers after the decoder's (blk.N with N >= its layers,
    `nextn.*` among them): kept beside the model for speculation (kvgen.model.mtp), not part of it."""
    return [name for name in tensors if config.mtp_layers and (m := re.match(r"blk\.(\d+)\.", name))
            and int(m.group(1)) >= config.num_layers]


def _mtp_tensors(path: Path, arch: Architecture, tensors: dict[str, ReaderTensor],
                 config: ModelConfig) -> dict[str, GGUFWeight]:
    """The MTP layers' tensors, raw, under HF's names: blk.(layers + j).X as `mtp.layers.j.` + X's name
    in a decoder layer, and the nextn tensors as `mtp.` + NEXTN_NAMES' (a name kvgen does not know
    stays as it is, for the head to report)."""
    out = {}
    for name, tensor in tensors.items():
        layer, _, rest = name.removeprefix("blk.").partition(".")
        j = int(layer) - config.num_layers
        if rest.startswith("nextn."):
            hf = NEXTN_NAMES.get(rest, name) if j == 0 else name
        else:
            hf = _hf_name(path, arch, name).replace(f"model.layers.{layer}.", f"mtp.layers.{j}.", 1)
        out[hf] = tensor
    try:
        return {hf: read_tensor(t, hf) for hf, t in out.items()}
    except (UnsupportedTensorType, ValueError) as e:
        raise ModelLoadError(path, f"MTP layers: {e}") from None


def _open(path: Path) -> GGUFFile:
    """The parsed header (metadata and tensor infos) over a memory map of the file."""
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(path, f"not a GGUF file, or a truncated or corrupt one: {e}") from None


def _metadata(path: Path, reader: GGUFFile) -> dict[str, Any]:
    """Every key-value field as a Python value (arrays as lists), parsed and checked by `_open`."""
    return reader.metadata


def _config(path: Path, arch: Architecture, meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; biases and tying are read off which tensors exist."""
    p = f"{arch.gguf_name}."
    try:
        hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
        head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
        kv_heads, widths = meta.get(p + "attention.head_count_kv", heads), _mlp_widths(p, meta)
        config = ModelConfig(
            vocab_size=_vocab_size(p, meta, tensors),
            hidden_size=hidden,
            intermediate_size=int(min(widths) if isinstance(widths, list) else widths),  # per layer: Gemma 4
            num_layers=int(meta[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads),  # per layer: Gemma 4
            head_dim=head_dim,
            max_position_embeddings=int(meta[p + "context_length"]),
            rms_norm_eps=_f32(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=_f32(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(p, meta, tensors),
            qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            tie_word_embeddings="output.weight" not in tensors,
            sliding_window=_sliding_window(p, meta),
            bos_token_id=token_id(meta, "bos"),
            eos_token_ids=stop_token_ids(meta),
            model_type=arch.name,
            architecture=arch.name,
        )
        config = replace(config, **arch.gguf_fields(p, meta, config)) if arch.gguf_fields else config
        if arch.gguf_tensor_fields:  # what only the tensors present say (Gemma 4's V taken from K)
            config = replace(config, **arch.gguf_tensor_fields(set(tensors), config))
        if int(meta.get(p + "rope.dimension_count", head_dim)) != (config.rotary_dim or head_dim):
            raise ValueError("partial rotary embeddings (rope.dimension_count != head dim) are not supported")
        return config
    except KeyError as e:
        raise ModelLoadError(path, f"GGUF metadata key {e.args[0]} is missing") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path, f"bad GGUF metadata: {e}") from None


def _mlp_widths(p: str, meta: dict[str, Any]) -> int | list[int]:
    """feed_forward_length, which a file whose every layer is a mixture of experts may leave out (a
    Qwen3.5-MoE's: its config has no dense width): 0 there."""
    return meta[p + "feed_forward_length"] if p + "expert_count" not in meta else meta.get(p + "feed_forward_length", 0)


def _sliding_window(p: str, meta: dict[str, Any]) -> int | None:
    """A window over every layer (Phi-3's); an architecture with per-layer windows sets its own."""
    window = meta.get(p + "attention.sliding_window")
    return int(window) if window else None


def _vocab_size(p: str, meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> int:
    """From the token list; without one, from {arch}.vocab_size or the embedding's row count."""
    if "tokenizer.ggml.tokens" in meta:
        return len(meta["tokenizer.ggml.tokens"])
    if f"{p}vocab_size" in meta:
        return int(meta[f"{p}vocab_size"])
    return int(tensors["token_embd.weight"].shape[-1])  # GGUF order: (hidden, vocab)


def _rope_scaling(p: str, meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any] | None:
    if ROPE_FREQS in tensors:
        return _proportional_rope(tensors[ROPE_FREQS])
    if "rope_factors_long.weight" in tensors:
        raise ValueError("per-frequency RoPE scaling (rope_factors_long) is not supported")
    kind = meta.get(f"{p}rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope scaling {kind!r} is not supported (linear and yarn are)")
    scaling = {"rope_type": kind, "factor": _f32(meta[f"{p}rope.scaling.factor"])}
    return scaling if kind == "linear" else scaling | _yarn(p, meta)


def _yarn(p: str, meta: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters as transformers names them, from the keys llama.cpp's converter writes."""
    keys = {"original_max_position_embeddings": "rope.scaling.original_context_length",
            "beta_fast": "rope.scaling.yarn_beta_fast", "beta_slow": "rope.scaling.yarn_beta_slow",
            "attention_factor": "rope.scaling.yarn_attn_factor"}
    if _f32(meta.get(f"{p}rope.scaling.yarn_ext_factor", 1.0)) != 1.0:
        raise ValueError("YaRN with an extrapolation factor other than 1 is not supported")
    return {name: _f32(meta[p + key]) for name, key in keys.items() if p + key in meta}


def _proportional_rope(tensor: ReaderTensor) -> dict[str, Any]:
    """A rope_freqs whose factors are 1 for the first pairs and huge for the rest (Gemma 4's global
    layers, as llama.cpp's converter writes "proportional" RoPE) as that scaling; other factors are
    refused."""
    factors = read_tensor(tensor, ROPE_FREQS).dequantize().tolist()
    rotated = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
    if any(f < UNROTATED for f in factors[rotated:]):
        raise ValueError("per-frequency RoPE scaling (rope_freqs other than 1 / unrotated) is not supported")
    return {"rope_type": "proportional", "partial_rotary_factor": rotated / len(factors)}


def _hf_name(path: Path, arch: Architecture, name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    block_names = arch.gguf_names
    m = _BLOCK_TENSOR.fullmatch(name)
    layer, kind, suffix = m.groups() if m is not None else (None, None, None)
    if f"{kind}.{suffix}" in block_names:  # a name mapped whole (qwen35's ssm_dt.bias -> dt_bias)
        return f"model.layers.{layer}.{block_names[f'{kind}.{suffix}']}"
    if m is None or kind not in block_names:
        raise ModelLoadError(path, f"unexpected tensor {name!r} for a {arch.gguf_name} GGUF")
    if block_names[kind] == arch.layer.scalar:  # a layer's scalar has no suffix in HF's names (Gemma 4)
        return f"model.layers.{layer}.{block_names[kind]}"
    return f"model.layers.{layer}.{block_names[kind]}" + (f".{suffix}" if suffix else "")


def _read_tensors(path: Path, arch: Architecture, tensors: dict[str, ReaderTensor]) -> dict[str, GGUFWeight]:
    """Every tensor, raw, under its HF name."""
    try:
        return {(hf := _hf_name(path, arch, name)): read_tensor(t, hf) for name, t in tensors.items()
                if name != ROPE_FREQS}
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
    """A matrix, or a stack of experts' matrices (kvgen.model.experts), of a block type."""
    return isinstance(weight, GGUFWeight) and weight.is_quantized and len(weight.shape) in (2, 3)


def _dequantize(path: Path, weight: GGUFWeight | torch.Tensor) -> torch.Tensor:
    """float32 values; a tensor (a bias already permuted) passes through."""
    if isinstance(weight, torch.Tensor):
        return weight
    try:
        return weight.dequantize()
    except ValueError as e:  # block bytes that do not fit the shape: a damaged file
        raise ModelLoadError(path, f"tensor {weight.name}: corrupt data: {e}") from None


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float32_value(value)
