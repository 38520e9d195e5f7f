"""The token embedding block: a lookup (float or packed, kvgen.model.linear_choice.Embedding, sharing
its table with a tied LM head), times sqrt(hidden) where the architecture scales it (Gemma)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvgen.architectures.spec import Architecture
from kvgen.config import ModelConfig


def embedding_scale(arch: Architecture, config: ModelConfig, dtype: torch.dtype) -> float | None:
    """sqrt(hidden), rounded to the model's dtype first as HF does, or None where embeddings are unscaled."""
    if not arch.embedding_scale:
        return None
    return torch.tensor(math.sqrt(config.hidden_size)).to(dtype).item()


def embed(lookup: Callable[[torch.Tensor], torch.Tensor], scale: float | None, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids [T] -> [T, hidden], a fresh tensor (`lookup`: kvgen.model.linear_choice.Embedding)."""
    x = lookup(token_ids)
    return x if scale is None else x.mul_(scale)
