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
    scale = _stored(w.abs().amax(dim=-1) / 127, None)[0]
    q = torch.round(w / _nonzero(scale)[..., None]).clamp_(-127, 127)
    return pack((q + 128).to(torch.uint8).reshape(weight.shape).numpy(), 128, 8, scale.numpy(), None, GROUP)


def quantize_int4(weight: torch.Tensor) -> PackedWeight:
    w = _groups(weight)
    low = w.amin(dim=-1)
    scale, low = _stored((w.amax(dim=-1) - low) / 15, low)
    q = torch.round((w - low[..., None]) / _nonzero(scale)[..., None]).clamp_(0, 15)
    return pack(q.to(torch.uint8).reshape(weight.shape).numpy(), 0, 4, scale.numpy(), low.numpy(), GROUP)


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in / 32, 32] on the CPU; torch's reductions over the groups run on every thread
    (numpy's took ~12 ns a weight on one, 9 s of loading a 0.5B model at --quantization int4)."""
    out, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"cannot quantize a {out}x{cols} weight in groups of {GROUP}: {cols} is not a multiple")
    return weight.detach().to("cpu", torch.float32).reshape(out, cols // GROUP, GROUP)


def _stored(scale: torch.Tensor, min: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The values as they will be stored: fp16 when every one is a normal fp16 number (or 0), so none
    loses bits to fp16's subnormals, else fp32 (pack keeps fp16 exactly when it can)."""
    arrays = [scale] + ([min] if min is not None else [])
    magnitudes = torch.cat([a.abs().ravel() for a in arrays])
    fits = bool(((magnitudes == 0) | ((magnitudes >= FP16_NORMAL) & (magnitudes <= FP16_MAX))).all())
    rounded = [a.to(torch.float16).to(torch.float32) if fits else a.to(torch.float32) for a in arrays]
    return rounded[0], rounded[1] if min is not None else None


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Divisor for the codes: an all-zero group (scale 0) gets codes 0 (int4: min = its value)."""
    return torch.where(scale == 0, 1.0, scale)
