"""The packed weight format the quantized kernels read, and its reference dequantization.

A weight [out, in] is kept as unsigned codes u, an integer offset o and, per group of `group`
consecutive weights of a row, a scale s and an optional min m:

    w = s * (u - o) + m            (computed in fp32: (u - o) is exact, s * (u - o) is exact for every
                                    GGUF type mapped here, so the only rounding is the "+ m", as in gguf)

Rows go in tiles of 4 (the last tile padded with zero rows), each tile stored span by span (a span
is 32 weights of a row), so that the kernel reads one tile as one sequential stream and unpacks the
same 32 columns of 4 rows with one 64-byte load:

    bits 4: per (tile, span) 4 rows x 16 bytes, byte j = element j (low nibble) | element j+16 (high
            nibble), the in-block layout of GGUF Q4_0/Q4_1; group 32.
    bits 8: per (tile, span) 2 halves x 4 rows x 16 bytes (elements 0-15 of the 4 rows, then 16-31);
            group 32, or 16 (Q6_K, Q3_K, Q2_K have 16-weight sub-blocks).
    scales, mins: per (tile, group) the 4 rows' values.

Scales and mins are fp16 where every value is one (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 store fp16), else fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

GROUP = 32  # weights per span (and per group, except groups of 16)
TILE = 4    # rows per tile


@dataclass(frozen=True)
class PackedWeight:
    codes: torch.Tensor         # uint8 [tiles, in * 4 * bits / 8], tiles = ceil(out / 4)
    scale: torch.Tensor         # float16 or float32 [tiles, in / group * 4]
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

    def to(self, device: torch.device) -> PackedWeight:
        return replace(self, codes=self.codes.to(device), scale=self.scale.to(device),
                       min=None if self.min is None else self.min.to(device))


def pack(q: np.ndarray, offset: int, bits: int, scale: np.ndarray, min: np.ndarray | None,
         group: int) -> PackedWeight:
    """q: codes uint8 [out, in] (0..2^bits-1), scale/min fp32 [out, in / group] -> PackedWeight in
    tiles, with fp16 scales and mins where that keeps every value."""
    out, cols = q.shape
    assert cols % GROUP == 0 and scale.shape == (out, cols // group) and q.dtype == np.uint8
    tiles, spans = -(-out // TILE), cols // GROUP
    q = _pad_rows(q, tiles * TILE)
    if bits == 4:
        halves = q.reshape(tiles * TILE, spans, 2, GROUP // 2)
        nibbles = halves[:, :, 0] | (halves[:, :, 1] << np.uint8(4))  # [rows, spans, 16]
        codes = nibbles.reshape(tiles, TILE, spans, GROUP // 2).transpose(0, 2, 1, 3)
    else:
        codes = q.reshape(tiles, TILE, spans, 2, GROUP // 2).transpose(0, 2, 3, 1, 4)
    arrays = [scale] + ([min] if min is not None else [])
    narrow = group == GROUP and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)
    dtype = np.float16 if narrow else np.float32

    def tiled(a: np.ndarray | None) -> torch.Tensor | None:
        if a is None:
            return None
        a = _pad_rows(a.astype(dtype), tiles * TILE).reshape(tiles, TILE, -1).transpose(0, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(a).reshape(tiles, -1))

    codes = torch.from_numpy(np.ascontiguousarray(codes).reshape(tiles, -1))
    return PackedWeight(codes, tiled(scale), tiled(min), offset, bits, group, (out, cols))


def dequantize_rows(w: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """dequantize(w)[rows] (rows int64 [n]) -> fp32 [n, in], reading only those rows' tiles: an
    embedding lookup in a table that stays packed (tied embeddings share it with the LM head)."""
    tiles = rows // TILE
    picked = replace(w, codes=w.codes[tiles], scale=w.scale[tiles],
                     min=None if w.min is None else w.min[tiles], shape=(len(rows) * TILE, w.shape[1]))
    return dequantize(picked)[torch.arange(len(rows), device=rows.device) * TILE + rows % TILE]


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """The weights one above the other ([sum of out, in]), for fused projections (q/k/v, gate/up):
    one kernel call instead of several. The parts must share codes, offset, group and having mins;
    the scales stay fp16 only if every part's are."""
    first = parts[0]
    kinds = {(p.bits, p.offset, p.group, p.min is None, p.shape[1]) for p in parts}
    if len(kinds) > 1:
        raise ValueError(f"cannot stack packed weights of different formats: {sorted(kinds)}")
    codes = np.concatenate([unpack_codes(p).numpy() for p in parts])
    scale = np.concatenate([untile(p.scale, p).float().numpy() for p in parts])
    mins = None if first.min is None else np.concatenate([untile(p.min, p).float().numpy() for p in parts])
    return pack(codes, first.offset, first.bits, scale, mins, first.group)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return a if a.shape[0] == rows else np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def unpack_codes(w: PackedWeight) -> torch.Tensor:
    """The codes as uint8 [out, in], in row order."""
    out, cols = w.shape
    tiles, spans = w.codes.shape[0], cols // GROUP
    if w.bits == 4:
        packed = w.codes.reshape(tiles, spans, TILE, 1, GROUP // 2)
        halves = torch.cat([packed & 0x0F, packed >> 4], dim=3)  # [tiles, spans, 4, 2, 16]
        rows = halves.permute(0, 2, 1, 3, 4)
    else:
        rows = w.codes.reshape(tiles, spans, 2, TILE, GROUP // 2).permute(0, 3, 1, 2, 4)
    return rows.reshape(tiles * TILE, cols)[:out]


def untile(values: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Scales or mins [tiles, groups * 4] -> [out, groups] in row order."""
    tiles = values.shape[0]
    return values.reshape(tiles, -1, TILE).permute(0, 2, 1).reshape(tiles * TILE, -1)[: w.shape[0]]


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The fp32 weight [out, in] the format stands for, on the codes' device."""
    out, cols = w.shape
    q = (unpack_codes(w).to(torch.int32) - w.offset).to(torch.float32).reshape(out, cols // w.group, w.group)
    values = q * untile(w.scale, w).to(torch.float32)[..., None]
    if w.min is not None:
        values = values + untile(w.min, w).to(torch.float32)[..., None]
    return values.reshape(out, cols)
