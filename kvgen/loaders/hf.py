"""Hugging Face model directories: config.json + safetensors (single file or sharded) + tokenizer files.

Special tokens, BOS handling and the chat template come from tokenizer_config.json,
special_tokens_map.json, chat_template.jinja / chat_template.json and generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from kvgen.config import ModelConfig, text_part
from kvgen.errors import ModelLoadError
from kvgen.loaders.experts import stack_experts
from kvgen.loaders.weights import LoadedModel, finalize_weights, is_norm_weight, shard_plan
from kvgen.loaders.tokenizers import HFTokenizer, SentencePieceTokenizer
from kvgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    import sentencepiece

    from kvgen.loaders.shard import ShardPlan, Slice

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
MULTIMODAL_TEXT_PREFIX = "model.language_model."  # the text model in transformers' ...ForConditionalGeneration
MTP_PREFIX = "mtp."  # multi-token-prediction layers beside the model (Qwen3.5's): kvgen.model.mtp


def load_hf(
    path: Path,
    *,
    tokenizer: Tokenizer | None,
    device: str | torch.device,
    dtype: torch.dtype,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Loads a HF directory; the tokenizer is the directory's own unless `tokenizer` is given.
    Norm weights come out as the factor the norm multiplies by: Gemma's stored w becomes 1 + w (in
    fp32, as Gemma's RMSNorm adds it), so every architecture runs one RMSNorm. A tensor-parallel
    `shard` reads only its slices from the files (`safe_open(...).get_slice`)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(config_file, "missing: a HF model directory needs config.json")
    raw_config = _read_json(config_file)
    config = ModelConfig.from_hf(raw_config, source=config_file)
    config = _with_generation_ids(config, _read_json(path / "generation_config.json", default={}))
    plan = shard_plan(config, shard, path)
    weights, origins, shapes = _read_safetensors(path, plan, text_only=text_part(raw_config) is not raw_config)
    if config.is_moe:  # experts stacked per layer (kvgen.loaders.experts)
        weights = stack_experts(weights, config, path)
        shapes = {name: tuple(w.shape) for name, w in weights.items()}
    if tokenizer is None:
        tokenizer = load_hf_tokenizer(path, eos_token_ids=config.eos_token_ids)
    if config.arch.norm_plus_one:
        plain = config.arch.plain_norms
        weights = {name: w.float() + 1.0 if is_norm_weight(name) and not name.endswith(plain) else w
                   for name, w in weights.items()}
    mtp = _split_mtp(weights, config, path)
    shapes = {name: shape for name, shape in shapes.items() if not name.startswith(MTP_PREFIX)}
    weights = finalize_weights(weights, config, path, device, dtype, origins=origins, shapes=shapes)
    mtp = {name: w.to(device=device, dtype=dtype) for name, w in mtp.items()} if plan is None else {}
    return LoadedModel(config, weights, tokenizer, str(path), shard=plan, mtp=mtp)


def _split_mtp(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Takes the MTP layers' tensors (`mtp.*`) out of `weights`; a mixture's experts among them stacked
    as the model's are (kvgen.loaders.experts)."""
    mtp = {name: weights.pop(name) for name in [n for n in weights if n.startswith(MTP_PREFIX)]}
    if not config.is_moe:
        return mtp
    as_model = {re.sub(r"^mtp\.layers\.(\d+)\.", r"model.layers.\1.", name): w for name, w in mtp.items()}
    return {re.sub(r"^model\.layers\.(\d+)\.", r"mtp.layers.\1.", name): w
            for name, w in stack_experts(as_model, config, path).items()}


def load_hf_tokenizer(
    path: Path, *, tokenizer_file: Path | None = None, eos_token_ids: tuple[int, ...] = ()
) -> Tokenizer:
    """The tokenizer of a HF directory: `tokenizer.json` if present, else SentencePiece `tokenizer.model`.

    `eos_token_ids` (from the model and generation configs) all stop generation, beside the tokenizer's EOS.
    """
    tokenizer_file = tokenizer_file or _find_tokenizer_file(path)
    settings = _read_json(path / "tokenizer_config.json", default={})
    special_map = _read_json(path / "special_tokens_map.json", default={})
    template = _chat_template(path, settings)
    if tokenizer_file.suffix == ".model":
        return SentencePieceTokenizer(
            _open_sentencepiece(tokenizer_file),
            add_bos=bool(settings.get("add_bos_token", True)),
            extra_stop_ids=eos_token_ids,
            chat_template=template,
        )
    tok = _open_tokenizer_json(tokenizer_file)
    eos_fallback = tok.id_to_token(eos_token_ids[0]) if eos_token_ids else None
    return HFTokenizer(
        tok,
        bos_token=_token_text(settings, special_map, "bos_token"),
        eos_token=_token_text(settings, special_map, "eos_token") or eos_fallback,
        add_bos=settings.get("add_bos_token"),
        extra_stop_ids=eos_token_ids,
        chat_template=template,
    )


def _with_generation_ids(config: ModelConfig, generation: dict[str, Any]) -> ModelConfig:
    """Adds generation_config.json's EOS ids (an int or a list) to the config's, and its BOS if the config has none.

    Instruct models often list their end-of-turn token only there (Llama 3: 128009).
    """
    extra = generation.get("eos_token_id")
    extra_ids = [int(i) for i in (extra if isinstance(extra, list) else [extra] if extra is not None else [])]
    eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra_ids]))
    bos = config.bos_token_id if config.bos_token_id is not None else generation.get("bos_token_id")
    return dataclasses.replace(config, eos_token_ids=eos_ids, bos_token_id=bos)


def _read_safetensors(path: Path, plan: ShardPlan | None = None, text_only: bool = False) -> tuple[
        dict[str, torch.Tensor], dict[str, Path], dict[str, tuple[int, ...]]]:
    """Every tensor of `model.safetensors`, or of the shards `model.safetensors.index.json` names
    (the `plan`'s slice of it, if given), the file each came from, and its full shape. `text_only`:
    a multimodal checkpoint's text model only, under the text model's names (`_text_name`)."""
    if (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    elif (path / SHARD_INDEX).is_file():
        weight_map = _read_json(path / SHARD_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(path / SHARD_INDEX, "no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(path, f"no {SINGLE_FILE} or {SHARD_INDEX}")
    weights: dict[str, torch.Tensor] = {}
    origins: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(file, "missing shard")
        try:
            with safe_open(file, framework="pt") as shard:
                for stored in shard.keys():
                    if (name := _text_name(stored) if text_only else stored) is None:
                        continue
                    tensor_slice = shard.get_slice(stored)
                    shapes[name] = tuple(tensor_slice.get_shape())
                    weights[name] = _read_part(tensor_slice, plan.slice_of(name) if plan else None)
                    origins[name] = file
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(file, f"unreadable safetensors file: {e}") from None
    return weights, origins, shapes


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the text model's name (`model.language_model.X` ->
    `model.X`, the LM head and MTP layers as they are), or None for the vision and audio towers and
    their projections."""
    if name.startswith(MULTIMODAL_TEXT_PREFIX):
        return "model." + name[len(MULTIMODAL_TEXT_PREFIX):]
    return name if name.startswith(("lm_head.", MTP_PREFIX)) else None


def _read_part(tensor_slice, part: Slice | None) -> torch.Tensor:
    """The whole tensor, or rows / columns [start, stop) of it: only those bytes are read."""
    if part is None:
        return tensor_slice[:]
    index = [slice(None)] * len(tensor_slice.get_shape())
    index[part.dim] = slice(part.span.start, part.span.stop)
    values = tensor_slice[tuple(index)]
    return torch.zeros_like(values) if part.zero else values


def _find_tokenizer_file(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (path / name).is_file():
            return path / name
    raise ModelLoadError(path, "no tokenizer.json or tokenizer.model")


def _open_tokenizer_json(file: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises bare `Exception` for unreadable files
        raise ModelLoadError(file, f"unreadable tokenizer.json: {e}") from None


def _open_sentencepiece(file: Path) -> sentencepiece.SentencePieceProcessor:
    import sentencepiece  # only for a .model tokenizer: `import kvgen` runs without the library

    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (RuntimeError, OSError) as e:
        raise ModelLoadError(file, f"unreadable SentencePiece model: {e}") from None


def _token_text(settings: dict[str, Any], special_map: dict[str, Any], key: str) -> str | None:
    """A special token's text; tokenizer files store it as a string or as {"content": ...}."""
    value = settings.get(key) or special_map.get(key)
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: Path, settings: dict[str, Any]) -> str | None:
    """From chat_template.jinja, chat_template.json or tokenizer_config.json (a string or named templates)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json", default={}).get("chat_template") or settings.get(
        "chat_template"
    )
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _read_json(file: Path, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON object from `file`; `default` when given and the file is absent."""
    if default is not None and not file.is_file():
        return default
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(file, f"unreadable JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(file, "expected a JSON object")
    return value
