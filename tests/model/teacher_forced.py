"""Teacher-forced comparison of a GGUF's packed model with its dequantized self over real text: every
position's logits from one pass without a cache, and the share of positions where both pick the same
top token. The real-file quality bars (issue 15 on SmolLM2's Q4_1 file, issue 33 on llama.cpp's
requantized mixes of it, Gemma 3's Q4_K_M file) all measure this."""

from __future__ import annotations

from pathlib import Path

import torch

from kvgen.cache.state_pool import StatePool
from kvgen.config import ModelConfig
from kvgen.loaders import load_model
from kvgen.model.attention import NoCacheAttention
from kvgen.model.decoder import DecoderModel
from kvgen.runner.state_batch import StepStates


def all_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] in one pass without a cache (each layer's window kept; a
    recurrent model's layers from a fresh state)."""
    windows = [model.config.window(i) for i in range(model.config.num_layers)]
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), NoCacheAttention(windows),
                           states=fresh_state(model.config, len(ids)))
    return model.logits(hidden)


def fresh_state(config: ModelConfig, num_tokens: int) -> StepStates | None:
    """One prompt of `num_tokens` from a zero state in a pool of one slot (None: no recurrent layers)."""
    if not config.recurrent_layers:
        return None
    pool = StatePool(config.recurrent, len(config.recurrent_layers), 1)
    slot = pool.allocate()
    return StepStates(pool, {layer: i for i, layer in enumerate(config.recurrent_layers)}, torch.tensor([slot]),
                      [0, num_tokens], 0, [None])


def packed_model(path: Path) -> DecoderModel:
    """The file's model on its packed blocks (`quantization="auto"`)."""
    loaded = load_model(path, keep_quantized=True)
    return DecoderModel(loaded.config, {**loaded.weights, **loaded.quantized}, quantization="auto")


def top1_agreement(want: torch.Tensor, got: torch.Tensor) -> float:
    """The share of positions (rows of two [positions, vocab] logits) whose argmax is the same."""
    return (want.argmax(-1) == got.argmax(-1)).float().mean().item()
