"""kquant_format's layout computed with numpy, field by field from gguf_blocks.k_fields: the oracle
the C packer (kquant_pack.c, KQuantKernel.pack) is tested against byte for byte, and the packer of
the layout tests on CPUs without the kernel. Written from the layout's definition (kquant.c's
header), not from the C code."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.model.formats.gguf_blocks import QK_K, KFields, k_fields
from kvgen.model.formats.kquant import HIGH, LOW, PANEL, KPacked

Q = GGMLQuantizationType


def pack_k(ggml_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> KPacked:
    """raw uint8 [out, bytes per row] of a Q4_K/Q5_K/Q6_K matrix of `shape` (out, in) -> KPacked."""
    out, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    assert ggml_type in HIGH and cols % block_size == 0 and raw.shape == (out, cols // block_size * type_size)
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
