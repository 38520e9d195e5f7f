"""Model loading: one `load_model(path)` that detects the format.

Formats: a Hugging Face directory (config.json + safetensors, single or sharded), a GGUF file, and a
llama2.c legacy checkpoint (.bin with a tok*.bin tokenizer beside it). Every loader returns weights
in Hugging Face naming and layout (q/k rows in rotate-half order), so the model has one code path.
Nothing is unpickled.

What the format modules share (the expected-shapes table every loader validates against,
`LoadedModel`) is in `kvgen.loaders.weights`; the q/k row permutation from interleaved-pair RoPE
(llama2.c, GGUF) to rotate-half in `kvgen.loaders.rope_layout`; which slice of each weight a
tensor-parallel rank loads in `kvgen.loaders.shard`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from kvgen.errors import ModelLoadError
from kvgen.loaders.gguf_file import load_gguf
from kvgen.loaders.hf import load_hf, load_hf_tokenizer
from kvgen.loaders.llama2c import load_llama2c, load_llama2c_tokenizer
from kvgen.loaders.weights import LoadedModel, expected_shapes
from kvgen.tokenizer import Tokenizer

__all__ = ["LoadedModel", "expected_shapes", "load_model", "load_tokenizer"]


def load_model(
    path: str | Path,
    *,
    tokenizer_path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Loads a HF directory, a `.gguf` file or a llama2.c `.bin` checkpoint (format from the path).

    `tokenizer_path` overrides the tokenizer the format implies: a HF directory, a `tokenizer.json`,
    a SentencePiece `.model` or a llama2.c `tok*.bin`. `keep_quantized` leaves a GGUF's
    block-quantized matrices raw in `LoadedModel.quantized` instead of dequantizing them. `shard`
    (rank, world) loads one tensor-parallel rank's slices (see kvgen.loaders.shard).
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if path.is_dir():
        loader = load_hf
    elif path.suffix == ".gguf":
        loader = partial(load_gguf, keep_quantized=keep_quantized)
    elif path.suffix == ".bin":
        loader = load_llama2c
    else:
        raise ModelLoadError(path, "unknown model format (expected a HF directory, a .gguf or a llama2.c .bin)")
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    return loader(path, tokenizer=tokenizer, device=device, dtype=dtype, shard=shard)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a tokenizer on its own: a HF directory, `tokenizer.json`, SentencePiece `.model`, llama2.c `.bin`."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "no such tokenizer file or directory")
    if path.is_dir():
        return load_hf_tokenizer(path)
    if path.suffix in (".json", ".model"):
        return load_hf_tokenizer(path.parent, tokenizer_file=path)
    if path.suffix == ".bin":
        return load_llama2c_tokenizer(path)
    raise ModelLoadError(path, "unknown tokenizer format (expected tokenizer.json, a .model or a llama2.c tok*.bin)")
