"""The packed weight format the quantized kernels read, and its reference dequantization.

A weight [out, in] is kept as unsigned codes u, an integer offset o and, per group of `group`
consecutive weights of a row, a scale s and an optional min m:

    w = s * (u - o) + m            (computed in fp32: (u - o) is exact, s * (u - o) is exact for every
                                    GGUF type mapped here, so the only rounding is the "+ m", as in gguf)

    bits 4: 16 bytes per 32 weights, byte j = element j (low nibble) | element j + 16 (high nibble),
            the in-block layout of GGUF Q4_0/Q4_1; group 32.
    bits 8: one byte per weight; group 32, or 16 (Q6_K, Q3_K, Q2_K have 16-weight sub-blocks).

Scales and mins are fp16 where every value is one (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 store fp16), else fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32


@dataclass(frozen=True)
class PackedWeight:
    codes: torch.Tensor         # uint8 [out, in * bits / 8]
    scale: torch.Tensor         # float16 or float32 [out, in / group]
    min: torch.Tensor | None    # like scale, or None for 0
    offset: int
    bits: int
    group: int
    shape: tuple[int, int]      # (out, in)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call: codes, scales and mins."""
        tensors = [self.codes, self.scale] + ([self.min] if self.min is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> "PackedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWeight(move(self.codes), move(self.scale), move(self.min), self.offset, self.bits,
                            self.group, self.shape)


def pack(q: np.ndarray, offset: int, bits: int, scale: np.ndarray, min: np.ndarray | None,
         group: int) -> PackedWeight:
    """q: codes uint8 [out, in] (0..2^bits-1), scale/min fp32 [out, in / group] -> PackedWeight, with
    fp16 scales and mins where that keeps every value."""
    out, cols = q.shape
    assert cols % GROUP == 0 and scale.shape == (out, cols // group) and q.dtype == np.uint8
    if bits == 4:
        halves = q.reshape(out, cols // GROUP, 2, GROUP // 2)
        codes = (halves[:, :, 0] | (halves[:, :, 1] << np.uint8(4))).reshape(out, cols // 2)
    else:
        codes = q
    arrays = [scale] + ([min] if min is not None else [])
    narrow = group == GROUP and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)
    dtype = np.float16 if narrow else np.float32
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a.astype(dtype)))  # noqa: E731
    return PackedWeight(torch.from_numpy(np.ascontiguousarray(codes)), as_tensor(scale), as_tensor(min), offset,
                        bits, group, (out, cols))


def unpack_codes(w: PackedWeight) -> torch.Tensor:
    """The codes as uint8 [out, in]."""
    if w.bits == 8:
        return w.codes
    out, cols = w.shape
    packed = w.codes.reshape(out, cols // GROUP, 1, GROUP // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(out, cols)


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The fp32 weight [out, in] the format stands for, on the codes' device."""
    out, cols = w.shape
    q = (unpack_codes(w).to(torch.int32) - w.offset).to(torch.float32).reshape(out, cols // w.group, w.group)
    values = q * w.scale.to(torch.float32)[..., None]
    if w.min is not None:
        values = values + w.min.to(torch.float32)[..., None]
    return values.reshape(out, cols)
