"""The packed weight format the quantized kernels read, and its reference dequantization.

A weight [out, in] is kept as unsigned codes u, an integer offset o and, per group of `group`
consecutive weights of a row, a scale s and an optional min m:

    w = s * (u - o) + m            (computed in fp32: (u - o) is exact, s * (u - o) is exact for every
                                    GGUF type mapped here, so the only rounding is the "+ m", as in gguf)

Rows go in panels of 16 (the last panel padded with zero rows), each panel stored span by span (a
span is 32 weights of a row), so that the kernel reads one panel as one sequential stream. Within a
span the 16 rows are the 16 int32 lanes of a 64-byte vector, 4 consecutive codes a lane (as
kquant_format.py's K-quant panels): one vpdpbusd against 4 bytes of x broadcast gives each row's
sum in its own lane, and the codes unpacked once serve every row of x.

    bits 4: per (panel, span) 4 vectors v of 16 rows x 4 bytes, byte b of row n's lane =
            element 8v + b (low nibble) | element 8v + 4 + b (high nibble): 256 bytes.
    bits 8: per (panel, span) 8 vectors g of 16 rows x 4 bytes, byte b = element 4g + b: 512 bytes;
            group 32, or 16 (Q6_K, Q3_K, Q2_K have 16-weight sub-blocks).
    scales, mins: per (panel, group) the 16 rows' values.

Scales and mins are fp16 where every value is one (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 store fp16), else fp32.

4-bit codes may index a codebook (CODEBOOKS): u is then the book's entry for the code. MXFP4's e2m1
values, doubled, are the integers 0, +-1, 2, 3, 4, 6, 8, 12: "e2m1" holds them plus 12, with offset 12,
so the file's 4.25 bits a weight stay 4.25 and the kernel maps a code as it unpacks it (qvec.h).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

GROUP = 32   # weights per span (and per group, except groups of 16)
PANEL = 16   # rows per panel
# code -> u, for 4-bit codes that index a book (qvec.h's E2M1_CODES)
CODEBOOKS = {"e2m1": (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)}


@dataclass(frozen=True)
class PackedWeight:
    codes: torch.Tensor         # uint8 [panels, in * 16 * bits / 8], panels = ceil(out / 16)
    scale: torch.Tensor         # float16 or float32 [panels, in / group * 16]
    min: torch.Tensor | None    # like scale, or None for 0
    offset: int
    bits: int
    group: int
    shape: tuple[int, int]      # (out, in)
    codebook: str | None = None  # a key of CODEBOOKS (4-bit codes), or None: u is the code

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call: codes, scales and mins."""
        tensors = [self.codes, self.scale] + ([self.min] if self.min is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> PackedWeight:
        return replace(self, codes=self.codes.to(device), scale=self.scale.to(device),
                       min=None if self.min is None else self.min.to(device))


def pack(q: np.ndarray, offset: int, bits: int, scale: np.ndarray, min: np.ndarray | None,
         group: int, codebook: str | None = None) -> PackedWeight:
    """q: codes uint8 [out, in] (0..2^bits-1), scale/min fp32 [out, in / group] -> PackedWeight in
    panels, with fp16 scales and mins where that keeps every value."""
    out, cols = q.shape
    assert cols % GROUP == 0 and scale.shape == (out, cols // group) and q.dtype == np.uint8
    panels, spans = -(-out // PANEL), cols // GROUP
    q = _pad_rows(q, panels * PANEL)
    if bits == 4:  # element 32s + 8v + 4h + b -> nibble h of byte b, vector v
        halves = q.reshape(panels, PANEL, spans, 4, 2, 4)
        nibbles = halves[:, :, :, :, 0] | (halves[:, :, :, :, 1] << np.uint8(4))  # [panels, rows, spans, v, b]
        codes = nibbles.transpose(0, 2, 3, 1, 4)
    else:  # element 32s + 4g + b -> byte b, vector g
        codes = q.reshape(panels, PANEL, spans, 8, 4).transpose(0, 2, 3, 1, 4)
    arrays = [scale] + ([min] if min is not None else [])
    with np.errstate(over="ignore"):  # a scale past fp16's range (MXFP4's) is not narrow: inf != it
        narrow = group == GROUP and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)
    dtype = np.float16 if narrow else np.float32

    def tiled(a: np.ndarray | None) -> torch.Tensor | None:
        if a is None:
            return None
        a = _pad_rows(a.astype(dtype), panels * PANEL).reshape(panels, PANEL, -1).transpose(0, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(a).reshape(panels, -1))

    codes = torch.from_numpy(np.ascontiguousarray(codes).reshape(panels, -1))
    return PackedWeight(codes, tiled(scale), tiled(min), offset, bits, group, (out, cols), codebook)


def dequantize_rows(w: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """dequantize(w)[rows] (rows int64 [n]) -> fp32 [n, in], reading only those rows' lanes: an
    embedding lookup in a table that stays packed (tied embeddings share it with the LM head)."""
    panels, lanes = rows // PANEL, rows % PANEL
    spans, groups = w.shape[1] // GROUP, w.shape[1] // w.group
    lane_bytes = w.codes.view(len(w.codes), spans, -1, PANEL, 4)[panels, :, :, lanes]  # [n, spans, vectors, 4]

    def picked(values: torch.Tensor) -> torch.Tensor:
        return values.view(len(values), groups, PANEL)[panels, :, lanes]  # [n, groups]

    return _values(_lane_codes(lane_bytes, w.bits), picked(w.scale), None if w.min is None else picked(w.min), w)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """The weights one above the other ([sum of out, in]), for fused projections (q/k/v, gate/up):
    one kernel call instead of several. The parts must share codes, offset, group and having mins;
    the scales stay fp16 only if every part's are."""
    first = parts[0]
    kinds = {(p.bits, p.offset, p.group, p.min is None, p.shape[1], p.codebook) for p in parts}
    if len(kinds) > 1:
        raise ValueError(f"cannot stack packed weights of different formats: {sorted(kinds)}")
    codes = np.concatenate([unpack_codes(p).numpy() for p in parts])
    scale = np.concatenate([untile(p.scale, p).float().numpy() for p in parts])
    mins = None if first.min is None else np.concatenate([untile(p.min, p).float().numpy() for p in parts])
    return pack(codes, first.offset, first.bits, scale, mins, first.group, first.codebook)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return a if a.shape[0] == rows else np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def _lane_codes(lane_bytes: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows' lanes of codes [..., spans, vectors, 4] (bytes) -> the rows' codes [..., in]."""
    leading = lane_bytes.shape[:-3]
    if bits == 4:  # byte b of vector v: element 8v + b (low nibble), 8v + 4 + b (high)
        lane_bytes = torch.stack([lane_bytes & 0x0F, lane_bytes >> 4], dim=-2)
    return lane_bytes.reshape(*leading, -1)


def unpack_codes(w: PackedWeight) -> torch.Tensor:
    """The codes as uint8 [out, in], in row order."""
    out, cols = w.shape
    panels, spans = w.codes.shape[0], cols // GROUP
    lane_bytes = w.codes.reshape(panels, spans, -1, PANEL, 4).permute(0, 3, 1, 2, 4)  # [panels, rows, spans, v, 4]
    return _lane_codes(lane_bytes, w.bits).reshape(panels * PANEL, cols)[:out]


def untile(values: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Scales or mins [panels, groups * 16] -> [out, groups] in row order."""
    panels = values.shape[0]
    return values.reshape(panels, -1, PANEL).permute(0, 2, 1).reshape(panels * PANEL, -1)[: w.shape[0]]


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The fp32 weight [out, in] the format stands for, on the codes' device."""
    return _values(unpack_codes(w), untile(w.scale, w), None if w.min is None else untile(w.min, w), w)


def _values(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None, w: PackedWeight) -> torch.Tensor:
    """Rows' codes uint8 [n, in], scales and mins [n, in / group] -> their fp32 values [n, in]."""
    rows, cols = codes.shape
    if w.codebook is not None:
        codes = torch.tensor(CODEBOOKS[w.codebook], dtype=torch.uint8, device=codes.device)[codes.long()]
    q = (codes.to(torch.int32) - w.offset).to(torch.float32).reshape(rows, cols // w.group, w.group)
    values = q * scale.to(torch.float32)[..., None]
    if min is not None:
        values = values + min.to(torch.float32)[..., None]
    return values.reshape(rows, cols)
