"""Float weights -> PackedWeight, for `--quantization int8|int4` on float checkpoints.

    int8  symmetric groups of 32, as llama.cpp's Q8_0: s = max|w| / 127, q = round(w / s)
    int4  asymmetric groups of 32, as Q4_1 (torchao's int4 with zero points): m = min w,
          s = (max w - m) / 15, q = round((w - m) / s) in 0..15

The scale (and min) is rounded to its storage precision first and the codes are computed from the
stored values, so each weight is within s/2 of the original (plus the min's rounding for int4).
"""

from __future__ import annotations

import numpy as np
import torch

from kvgen.model.formats.packed import GROUP, PackedWeight, pack

FP16_NORMAL = float(np.finfo(np.float16).tiny)
FP16_MAX = float(np.finfo(np.float16).max)


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    w = _groups(weight)  # [out, in/32, 32]
    scale = _stored(np.abs(w).max(axis=-1) / 127, None)[0]
    q = np.rint(w / _nonzero(scale)[..., None]).clip(-127, 127)
    return pack((q + 128).astype(np.uint8).reshape(weight.shape), 128, 8, scale, None, GROUP)


def quantize_int4(weight: torch.Tensor) -> PackedWeight:
    w = _groups(weight)
    low = w.min(axis=-1)
    scale, low = _stored((w.max(axis=-1) - low) / 15, low)
    q = np.rint((w - low[..., None]) / _nonzero(scale)[..., None]).clip(0, 15)
    return pack(q.astype(np.uint8).reshape(weight.shape), 0, 4, scale, low, GROUP)


def _groups(weight: torch.Tensor) -> np.ndarray:
    out, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"cannot quantize a {out}x{cols} weight in groups of {GROUP}: {cols} is not a multiple")
    return weight.detach().to("cpu", torch.float32).numpy().reshape(out, cols // GROUP, GROUP)


def _stored(scale: np.ndarray, min: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The values as they will be stored: fp16 when every one is a normal fp16 number (or 0), so none
    loses bits to fp16's subnormals, else fp32 (pack keeps fp16 exactly when it can)."""
    arrays = [scale] + ([min] if min is not None else [])
    magnitudes = np.abs(np.concatenate([a.ravel() for a in arrays]))
    fits = bool(np.all((magnitudes == 0) | ((magnitudes >= FP16_NORMAL) & (magnitudes <= FP16_MAX))))
    rounded = [a.astype(np.float16).astype(np.float32) if fits else a.astype(np.float32) for a in arrays]
    return rounded[0], rounded[1] if min is not None else None


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """Divisor for the codes: an all-zero group (scale 0) gets codes 0 (int4: min = its value)."""
    return np.where(scale == 0, 1, scale)
