"""What every loader shares: the weights a model needs by name and shape (`expected_shapes`,
`check_weights`), moving them to the device (`finalize_weights`), a tensor-parallel rank's plan
(`shard_plan`) and the `LoadedModel` a loader hands the engine. Kept apart from `kvgen.loaders`, which
picks the format, so that the format modules import these without importing their own dispatcher."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders.shard import ShardingError, ShardPlan
from kvgen.tokenizer import Tokenizer

if TYPE_CHECKING:
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
    rank's part: `weights` and `quantized` then hold that rank's slices only (kvgen.loaders.shard).
    `reload` loads the same files again for another rank (set by kvgen.llm.load; picklable).
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    quantized: dict[str, GGUFWeight] = field(default_factory=dict)
    shard: ShardPlan | None = None
    # The multi-token-prediction layers a checkpoint carries (Qwen3.5's), by HF name (`mtp.*`): float
    # tensors, or raw block-quantized matrices where `quantized` keeps them; for kvgen.model.mtp.
    mtp: dict[str, torch.Tensor | GGUFWeight] = field(default_factory=dict)
    reload: Callable[..., LoadedModel] | None = None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, HF names -> shape (lm_head only when untied): each layer's
    tensors as its architecture's description lists them (kvgen.architectures: its blocks, its norms),
    and any the architecture has beside its layers (Gemma 4's per-layer input table)."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + name: shape for name, shape in config.arch.layer_spec(i, config).tensors(config).items()}
    shapes["model.norm.weight"] = (hidden,)
    if config.arch.model_tensors is not None:
        shapes |= config.arch.model_tensors(config)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def is_norm_weight(name: str) -> bool:
    """An RMSNorm weight, by its HF name (the layers' norms, QK-norm, the final norm and an MTP layer's
    norms of its two inputs, `mtp.pre_fc_norm_embedding` / `_hidden`)."""
    return name.endswith(("norm.weight", "layernorm.weight")) or name.startswith("mtp.pre_fc_norm_")


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


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
