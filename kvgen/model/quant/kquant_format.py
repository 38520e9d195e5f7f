"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) in a layout close to the file's, for kquant.c.

The generic format of kvgen.model.quant.formats widens a K-quant's per-super-block integers into
fp32 scales and mins per sub-block and Q5_K/Q6_K's codes to 8 bits: 6 / 10 / 10 bits a weight where
the file takes 4.5 / 5.5 / 6.56. Decode reads every weight once a token, so those bytes cost
directly. This layout keeps the file's integers (sc, m as bytes, d and dmin fp16 per 256 columns,
4-bit codes plus 1 or 2 high-bit planes): 4.625 / 5.625 / 6.625 bits a weight.

Rows go in panels of 16 (the last padded with zero rows), each panel stored super-block by
super-block as one stream; kquant.c's header gives the bytes of a block. `dequantize` reads the
layout back (the reference the kernel is tested against); its values equal gguf's dequantization
bit for bit (d*sc*q - dmin*m and d*sc*(q - 32) in fp32, as gguf computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.model.quant.gguf_blocks import QK_K, KFields, k_fields

Q = GGMLQuantizationType
PANEL = 16   # rows per panel
META = 320   # bytes of a block's scales (kquant.c)
LOW = 2048   # bytes of a block's low nibbles
HIGH = {Q.Q4_K: 0, Q.Q5_K: 512, Q.Q6_K: 1024}  # bytes of a block's high-bit planes
KINDS = {Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}


@dataclass(frozen=True)
class KPacked:
    data: torch.Tensor         # uint8 [panels, blocks * block_bytes], panels = ceil(out / 16)
    ggml_type: Q
    shape: tuple[int, int]     # (out, in)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kind(self) -> str:
        return KINDS[self.ggml_type]


def block_bytes(ggml_type: Q) -> int:
    return META + LOW + HIGH[ggml_type]


def pack_k(ggml_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> KPacked:
    """raw uint8 [out, bytes per row] of a Q4_K/Q5_K/Q6_K matrix of `shape` (out, in) -> KPacked."""
    out, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if ggml_type not in HIGH or cols % block_size or raw.shape != (out, cols // block_size * type_size):
        raise ValueError(f"{ggml_type.name} blocks of shape {raw.shape} do not hold a {out}x{cols} K-quant matrix")
    panels = -(-out // PANEL)
    padded = np.zeros((panels * PANEL, raw.shape[1]), np.uint8)
    padded[:out] = raw
    f = k_fields(ggml_type, padded.reshape(panels, PANEL, cols // QK_K, type_size))  # [P, 16, nb, ...]
    parts = [_meta(f), _low(f.q)] + ([_high(f.q, ggml_type)] if HIGH[ggml_type] else [])
    data = np.concatenate(parts, axis=-1)  # [P, nb, block bytes]
    return KPacked(torch.from_numpy(np.ascontiguousarray(data).reshape(panels, -1)), ggml_type, shape)


def _by_block(a: np.ndarray) -> np.ndarray:
    """[P, 16 rows, nb, k] -> [P, nb, k * 16]: per block, entry by entry, the 16 rows."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(a.shape[0], a.shape[2], -1)


def _meta(f: KFields) -> np.ndarray:
    """The 320 bytes of scales per block [P, nb, 320]."""
    d = _by_block(f.d.astype(np.float16)).view(np.uint8)
    if f.m is None:  # Q6_K: sc int8 [16][16], d, zeros
        return np.concatenate([_by_block(f.sc).view(np.uint8), d, np.zeros_like(d)], axis=-1)
    return np.concatenate([_by_block(f.sc), _by_block(f.m), d, _by_block(f.dmin.astype(np.float16)).view(np.uint8)],
                          axis=-1)


def _low(q: np.ndarray) -> np.ndarray:
    """Low nibbles [P, nb, 2048]: per sub-block s, vector v, row n, byte b: q[32s+8v+b] | q[32s+8v+4+b] << 4."""
    P, _, nb, _ = q.shape
    c = (q & 0x0F).reshape(P, PANEL, nb, 8, 4, 2, 4)  # [P, n, nb, s, v, half, b]
    nib = c[..., 0, :] | (c[..., 1, :] << 4)           # [P, n, nb, s, v, b]
    return nib.transpose(0, 2, 3, 4, 1, 5).reshape(P, nb, LOW)


def _high(q: np.ndarray, ggml_type: Q) -> np.ndarray:
    """High-bit planes [P, nb, 512 or 1024]: Q5_K lane n bit 8b+g = bit 4 of q[32s+4g+b]; Q6_K two
    vectors k per sub-block, lane n bits 8b+2j.. = bits 4-5 of q[32s+4(4k+j)+b]."""
    P, _, nb, _ = q.shape
    h = (q >> 4).astype(np.uint32)
    if ggml_type == Q.Q5_K:
        h = h.reshape(P, PANEL, nb, 8, 8, 4)  # [P, n, nb, s, g, b]
        shifts = 8 * np.arange(4, dtype=np.uint32) + np.arange(8, dtype=np.uint32)[:, None]  # [g, b]
        words = (h << shifts).sum(axis=(-2, -1), dtype=np.uint32)  # [P, n, nb, s]
        words = words.transpose(0, 2, 3, 1)                         # [P, nb, s, n]
    else:
        h = h.reshape(P, PANEL, nb, 8, 2, 4, 4)  # [P, n, nb, s, k, j, b]
        shifts = 8 * np.arange(4, dtype=np.uint32) + 2 * np.arange(4, dtype=np.uint32)[:, None]  # [j, b]
        words = (h << shifts).sum(axis=(-2, -1), dtype=np.uint32)  # [P, n, nb, s, k]
        words = words.transpose(0, 2, 3, 4, 1)                      # [P, nb, s, k, n]
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(P, nb, HIGH[ggml_type])


def dequantize(w: KPacked) -> torch.Tensor:
    """The fp32 weight [out, in] the layout stands for (read back from the packed bytes)."""
    return dequantize_rows(w, torch.arange(w.shape[0]))


def dequantize_rows(w: KPacked, rows: torch.Tensor) -> torch.Tensor:
    """dequantize(w)[rows] (rows int64 [n]) -> fp32 [n, in], reading only those rows' lanes of
    their panels: an embedding lookup in a table that stays packed (a tied LM head shares it)."""
    n, cols, nb = len(rows), w.shape[1], w.shape[1] // QK_K
    blocks = w.data[rows // PANEL].reshape(n, nb, block_bytes(w.ggml_type))
    lane = (torch.arange(n), rows % PANEL)

    def field(at: int, size: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Bytes [at, at + size) of each block, entries of 16 lanes -> the row's entries [n, nb, k]."""
        values = blocks[..., at:at + size].contiguous().view(dtype)
        return values.reshape(n, nb, -1, PANEL).permute(0, 3, 1, 2)[lane]

    low = field(META, LOW, torch.int32).contiguous().view(torch.uint8).reshape(n, nb, 32, 4)  # [n, nb, s*v, b]
    q = torch.stack([low & 0x0F, low >> 4], dim=-2).reshape(n, nb, QK_K).to(torch.int32)
    if HIGH[w.ggml_type]:
        q = q | (_high_bits(field(META + LOW, HIGH[w.ggml_type], torch.int32), w.ggml_type) << 4)
    d = field(256, 32, torch.float16).float()                          # [n, nb, 1]
    if w.ggml_type == Q.Q6_K:
        sc = field(0, 256, torch.int8).float()                         # [n, nb, 16]
        values = (d * sc)[..., None] * (q - 32).float().reshape(n, nb, 16, 16)
        return values.reshape(n, cols)
    sc, m = field(0, 128).float(), field(128, 128).float()             # [n, nb, 8]
    dmin = field(288, 32, torch.float16).float()
    return ((d * sc)[..., None] * q.reshape(n, nb, 8, 32).float() - (dmin * m)[..., None]).reshape(n, cols)


def _high_bits(words: torch.Tensor, ggml_type: Q) -> torch.Tensor:
    """A row's high-bit words [n, nb, 8 or 16] -> bits 4.. of its codes as int32 [n, nb, 256]."""
    n, nb = words.shape[:2]
    if ggml_type == Q.Q5_K:  # word s: bit 8b+g for column 32s+4g+b
        shifts = 8 * torch.arange(4) + torch.arange(8)[:, None]           # [g, b]
        return ((words[..., None, None] >> shifts) & 1).reshape(n, nb, QK_K)
    shifts = 8 * torch.arange(4) + 2 * torch.arange(4)[:, None]            # [j, b]; word 2s+k: column 32s+4(4k+j)+b
    return ((words[..., None, None] >> shifts) & 3).reshape(n, nb, QK_K)
