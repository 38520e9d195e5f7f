"""GGUF quantized blocks -> PackedWeight, keeping every dequantized value exactly.

`convert` reads a matrix's raw blocks (uint8 [out, bytes per row]) into the codes, scales and mins of
kvgen.model.formats.packed: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and MXFP4 in C (block_pack.c, which keeps
their fp16 scales as they are), the K-quants with the numpy converters below. gguf's own dequantizer computes
the same fp32 products and sums, so `formats.dequantize` of the result equals
`gguf.quants.dequantize` of the blocks bit for bit (the tests check every type):

    Q4_0  d*(q-8)               -> 4-bit, offset 8, scale d
    Q4_1  d*q + m               -> 4-bit, scale d, min m
    Q4_K  d*sc*q - dmin*m       -> 4-bit, per 32: scale d*sc, min -(dmin*m)      (exact products)
    Q8_0  d*q                   -> 8-bit, scale d
    Q5_0  d*(q-16)              -> 8-bit, scale d
    Q5_1  d*q + m               -> 8-bit, scale d, min m
    Q5_K  d*sc*q - dmin*m       -> 8-bit, per 32: scale d*sc, min -(dmin*m)
    Q6_K  d*sc*(q-32)           -> 8-bit, per 16: scale d*sc
    Q3_K  d*(sc-32)*q           -> 8-bit, per 16: scale d*(sc-32)
    Q2_K  d*sc*q - dmin*m       -> 8-bit, per 16: scale d*sc, min -(dmin*m)
    MXFP4 d*k, k = 2 x e2m1     -> 4-bit codes of the "e2m1" codebook (the e2m1 values doubled, + 12),
                                   offset 12, scale d = 2^(e - 128) (e8m0, halved as ggml's): the
                                   format's s * (u - o) holds them exactly, in the file's 4.25 bits

(8-bit codes are q + 128 - zero point, offset 128: what VNNI's unsigned-by-signed dot product wants.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.model.kernels.block_pack import BLOCK_TYPES, block_packer
from kvgen.model.formats.packed import PackedWeight, pack

Q = GGMLQuantizationType
QK_K = 256
# (codes uint8 [out, in], offset, bits, scale [out, in/group], min or None, group)
Parts = tuple[np.ndarray, int, int, np.ndarray, np.ndarray | None, int]


def convert(ggml_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight | None:
    """raw uint8 [out, bytes per row] of a matrix of `shape` (out, in) -> PackedWeight, or None for a
    type no kernel format keeps exactly (float types, IQ*, TQ*...), or that this machine cannot pack
    (Q4_0... where block_pack.c does not build)."""
    converter = CONVERTERS.get(ggml_type)
    packer = block_packer() if ggml_type in BLOCK_TYPES else None
    if converter is None and packer is None:
        return None
    out, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if cols % block_size or raw.shape != (out, cols // block_size * type_size) or raw.dtype != np.uint8:
        raise ValueError(f"{ggml_type.name} blocks of shape {raw.shape} ({raw.dtype}) do not hold a "
                         f"{out}x{cols} matrix")
    if packer is not None:
        return packer.pack(ggml_type, [raw])
    blocks = raw.reshape(out, cols // block_size, type_size)
    q, offset, bits, scale, min, group = converter(blocks)
    return pack(q.reshape(out, cols), offset, bits, scale.reshape(out, -1), None if min is None else min.reshape(out, -1), group)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as fp32 [out, blocks, 1]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).astype(np.float32)


def _bits(field: np.ndarray, count: int, width: int) -> np.ndarray:
    """[..., n] bytes -> [..., count, n]: field k holds bits [k*width, (k+1)*width) of each byte."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(count, 1)
    return (field[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes: bytes 0-3 hold
    scales 0-3 (low 6 bits), 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from bytes 8-11 and
    their high 2 from the top bits of bytes 0-3 / 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


class KFields(NamedTuple):
    """A Q4_K/Q5_K/Q6_K matrix's integers as the file holds them, per row and super-block: codes q
    [..., 256] (0..2^bits-1), sub-block scales sc [..., 8] (uint8, 6 bits) or [..., 16] (Q6_K,
    int8), mins m [..., 8] (uint8) or None, and d / dmin fp32 [..., 1] (fp16 values; dmin None for
    Q6_K). Values: d*sc*q - dmin*m per 32 (Q4_K, Q5_K), d*sc*(q - 32) per 16 (Q6_K)."""

    q: np.ndarray
    sc: np.ndarray
    m: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None


def k_fields(ggml_type: Q, b: np.ndarray) -> KFields:
    """Blocks uint8 [..., type size] of a Q4_K, Q5_K or Q6_K matrix -> their KFields."""
    lead = b.shape[:-1]
    if ggml_type == Q.Q6_K:  # per 128-weight half: ql's 64 bytes give weights 0-63 (low nibbles) and
        ql = b[..., 0:128].reshape(*lead, 2, 64)  # 64-127 (high); qh's 32 give 2 high bits to l, 32+l, 64+l, 96+l
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [..., 2, 128]
        high = _bits(b[..., 128:192].reshape(*lead, 2, 32), 4, 2).reshape(*lead, 2, 128)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        return KFields((low | (high << 4)).reshape(*lead, QK_K), sc, None, _f16(b, 208), None)
    sc, m = _k_scales(b[..., 4:16])
    qs_at = 16 if ggml_type == Q.Q4_K else 48  # each 32 bytes of qs: sub-blocks 2i (low) and 2i+1 (high)
    qs = b[..., qs_at:qs_at + 128].reshape(*lead, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, QK_K)
    if ggml_type == Q.Q5_K:  # sub-block k: bit k of qh[0..31]
        q = q | (_bits(b[..., 16:48], 8, 1).reshape(*lead, QK_K) << 4)
    return KFields(q, sc.astype(np.uint8), m.astype(np.uint8), _f16(b, 0), _f16(b, 2))


def _k_scaled(f: KFields) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per-32 scales d*sc and mins -(dmin*m) [..., 8] (exact products)."""
    return f.d * f.sc.astype(np.float32), -(f.dmin * f.m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Parts:
    f = k_fields(Q.Q4_K, b)
    return f.q, 0, 4, *_k_scaled(f), 32


def _q5_k(b: np.ndarray) -> Parts:
    f = k_fields(Q.Q5_K, b)
    return f.q + np.uint8(128), 128, 8, *_k_scaled(f), 32


def _q6_k(b: np.ndarray) -> Parts:
    f = k_fields(Q.Q6_K, b)
    return f.q + np.uint8(96), 128, 8, f.d * f.sc.astype(np.float32), None, 16  # q - 32 + 128


def _q3_k(b: np.ndarray) -> Parts:
    """2 low bits from qs (per 128-weight half, 4 shifts of 32 bytes), the third from hmask (bit k
    for weights 32k..32k+31, set meaning no -4); 6-bit scales minus 32."""
    lead = b.shape[:-1]
    low = _bits(b[..., 32:96].reshape(*lead, 2, 32), 4, 2).reshape(*lead, QK_K)
    high = _bits(b[..., 0:32], 8, 1).reshape(*lead, QK_K)
    q = low + (high << 2) + np.uint8(124)  # low - 4 * (1 - high) + 128
    packed = b[..., 96:108]
    low_sc = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    high_sc = _bits(packed[..., 8:12], 4, 2).reshape(*lead, 16)
    sc = (low_sc | (high_sc << 4)).astype(np.float32) - 32
    return q, 128, 8, _f16(b, 108) * sc, None, 16


def _q2_k(b: np.ndarray) -> Parts:
    lead = b.shape[:-1]
    q = _bits(b[..., 16:80].reshape(*lead, 2, 32), 4, 2).reshape(*lead, QK_K) + np.uint8(128)
    sc = b[..., 0:16]
    return q, 128, 8, _f16(b, 80) * (sc & 0x0F), -(_f16(b, 82) * (sc >> 4)), 16


CONVERTERS: dict[Q, Callable[[np.ndarray], Parts]] = {
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k,
}
