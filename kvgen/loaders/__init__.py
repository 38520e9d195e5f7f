"""Model loading: one `load_model(path)` that detects the format.

Formats: a Hugging Face directory (config.json + safetensors, single or sharded), a GGUF file, and a
llama2.c legacy checkpoint (.bin with a tok*.bin tokenizer beside it). Every loader returns weights
in Hugging Face naming and layout (q/k rows in rotate-half order), so the model has one code path.
Nothing is unpickled.

Shared here: the expected-shapes table every loader validates against (`finalize_weights`) and the
q/k row permutation from interleaved-pair RoPE (llama2.c, GGUF) to rotate-half (`interleaved_to_half`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvgen.distributed.shard import ShardPlan
    from kvgen.loaders.gguf_tensors import GGUFWeight

# Tensors older HF checkpoints carry that hold nothing the model needs (RoPE tables it recomputes).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """What a loader hands the engine: config, weights (HF names), tokenizer, and where it came from.

    `quantized` holds the block-quantized GGUF matrices, raw, when `load_model(keep_quantized=True)`
    asked for them; those names are then absent from `weights`. Otherwise it is empty and `weights`
    has every tensor.

    `shard` is the tensor-parallel rank's plan when `load_model(shard=(rank, world))` asked for one
    rank's part: `weights` and `quantized` then hold that rank's slices only (kvgen.distributed.shard).
    `reload` loads the same files again for another rank (set by kvgen.llm.load; picklable).
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    quantized: dict[str, GGUFWeight] = field(default_factory=dict)
    shard: ShardPlan | None = None
    reload: Callable[..., LoadedModel] | None = None


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
    (rank, world) loads one tensor-parallel rank's slices (see kvgen.distributed.shard).
    """
    # Imported here: the format modules import the helpers below from this package.
    from kvgen.loaders.gguf_file import load_gguf
    from kvgen.loaders.hf import load_hf
    from kvgen.loaders.llama2c import load_llama2c

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
    from kvgen.loaders.hf import load_hf_tokenizer
    from kvgen.loaders.llama2c import load_llama2c_tokenizer

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


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, HF names -> shape (lm_head only when untied); which ones follow
    from the architecture (kvgen.model.architectures): fused or separate projections, QK-norm, its norms."""
    arch = config.arch
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + name + ".weight": (hidden,) for name in arch.layer_norm_names()}
        if arch.fused_checkpoint:
            shapes |= {p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                       p + "mlp.gate_up_proj.weight": (2 * inter, hidden)}
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (q_rows, hidden),
                p + "self_attn.k_proj.weight": (kv_rows, hidden),
                p + "self_attn.v_proj.weight": (kv_rows, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
            }
        shapes |= {p + "self_attn.o_proj.weight": (hidden, q_rows), p + "mlp.down_proj.weight": (hidden, inter)}
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv_rows,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def is_norm_weight(name: str) -> bool:
    """An RMSNorm weight, by its HF name (the layers' norms, QK-norm and the final norm)."""
    return name.endswith(("norm.weight", "layernorm.weight"))


def finalize_weights(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    source: object,
    device: str | torch.device,
    dtype: torch.dtype,
    *,
    origins: Mapping[str, object] | None = None,
    plan: ShardPlan | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Checks names and shapes (`check_weights`), then moves every tensor (the `plan`'s slice of it,
    if given) to device/dtype. `shapes`: the full shapes, where `weights` holds one rank's slices
    already (read so from the file).

    A tied `lm_head.weight` that a checkpoint stores anyway is dropped (the model reuses the embedding).
    """
    take = plan.take if plan is not None and shapes is None else lambda _, w: w
    shapes = shapes if shapes is not None else {name: tuple(w.shape) for name, w in weights.items()}
    names = check_weights(shapes, config, source, origins=origins)
    return {name: take(name, weights[name]).to(device=device, dtype=dtype) for name in names}


def shard_plan(config: ModelConfig, shard: tuple[int, int] | None, source: object) -> ShardPlan | None:
    """The plan of tensor-parallel rank `shard` = (rank, world) for this model, or None; a model that
    does not split so raises ModelLoadError naming `source`."""
    if shard is None:
        return None
    from kvgen.distributed.shard import ShardingError, ShardPlan

    try:
        return ShardPlan(config, *shard)
    except ShardingError as e:
        raise ModelLoadError(source, str(e)) from None


def check_weights(
    shapes: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    source: object,
    *,
    origins: Mapping[str, object] | None = None,
) -> list[str]:
    """Checks tensor names -> shapes against `expected_shapes(config)`; returns the names the model uses.

    `origins` names the file each tensor came from (sharded checkpoints), for the error message.
    """
    expected = expected_shapes(config)
    names = {n for n in shapes if not n.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")
    missing = sorted(set(expected) - names)
    if missing:
        if missing == ["lm_head.weight"]:
            raise ModelLoadError(source, "lm_head.weight is missing and the config does not tie embeddings")
        raise ModelLoadError(source, f"missing tensors: {_listing(missing)}")
    unexpected = sorted(names - set(expected))
    if unexpected:
        raise ModelLoadError(source, f"unexpected tensors (does the config match?): {_listing(unexpected)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            problem = f"{name} has shape {tuple(shapes[name])}, config implies {shape}"
            raise ModelLoadError((origins or {}).get(name, source), problem)
    return list(expected)


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorders q/k projection rows from interleaved-pair RoPE to HF's rotate-half layout.

    Within each head, rows (0,1),(2,3),... are the (real, imaginary) pairs in llama2.c and GGUF; HF wants
    all first halves, then all second halves: [x0, x1, x2, x3] -> [x0, x2, x1, x3]. This is the inverse of
    llama.cpp's `permute` in convert_hf_to_gguf.py and the `permute` in HF's convert_llama_weights_to_hf.py.
    """
    # w: [n_heads * head_dim, ...] -> [n_heads, head_dim/2, 2, ...] -> [n_heads, 2, head_dim/2, ...]
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
