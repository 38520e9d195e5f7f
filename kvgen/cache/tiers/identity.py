"""A model's identity for the disk tier: a digest of what makes its K/V what they are, so that a block
file is only ever read by the model and KV layout that wrote it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def _tensor_sample(t: object) -> bytes:
    """Name-independent facts of a weight: its type, shape and dtype, and its first bytes."""
    if isinstance(t, torch.Tensor):
        flat = t.detach().reshape(-1)[:64].cpu()
        raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat.contiguous().view(torch.uint8)
        return f"{tuple(t.shape)}{t.dtype}".encode() + raw.numpy().tobytes()
    return f"{type(t).__name__}{getattr(t, 'shape', '')}".encode()


def model_identity(model_config: object, weights: Mapping[str, object], layout: Mapping[str, object]) -> bytes:
    """32 bytes: the model's config, its weights' names, shapes, dtypes and first bytes, and the KV layout
    (`layout`: pool dtype, block size, layer kinds, heads, head dim, the dtype K/V are computed in...)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(repr(model_config).encode())
    for name in sorted(weights):
        h.update(name.encode())
        h.update(_tensor_sample(weights[name]))
    h.update(repr(sorted((k, repr(v)) for k, v in layout.items())).encode())
    return h.digest()
