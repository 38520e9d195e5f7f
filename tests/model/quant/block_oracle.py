"""The packed layout of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and MXFP4 blocks computed with numpy: each block's codes,
scales and mins as fp32 arrays, then formats.pack. The oracle the C packer (block_pack.c,
BlockPacker.pack) is tested against byte for byte; written from the GGUF block definitions, not from
the C code."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.model.formats.packed import PackedWeight, pack

Q = GGMLQuantizationType
# (codes uint8 [..., 32], offset, bits, scale [..., 1], min or None)
Parts = tuple[np.ndarray, int, int, np.ndarray, np.ndarray | None]


def pack_blocks(ggml_type: Q, raw: np.ndarray) -> PackedWeight:
    """raw uint8 [out, bytes per row] of a Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4 matrix -> PackedWeight."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    out, cols = raw.shape[0], raw.shape[1] // type_size * block_size
    q, offset, bits, scale, min = CONVERTERS[ggml_type](raw.reshape(out, -1, type_size))
    return pack(q.reshape(out, cols), offset, bits, scale.reshape(out, -1),
                None if min is None else min.reshape(out, -1), 32, "e2m1" if ggml_type == Q.MXFP4 else None)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as fp32 [out, blocks, 1]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-weight block -> [..., 32]: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> Parts:
    return _nibbles(b[..., 2:18]), 8, 4, _f16(b, 0), None


def _q4_1(b: np.ndarray) -> Parts:
    return _nibbles(b[..., 4:20]), 0, 4, _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Parts:
    return b[..., 2:34] ^ np.uint8(0x80), 128, 8, _f16(b, 0), None  # int8 q -> q + 128


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values [..., 32]: low 4 bits as in Q4, bit 4 of element i is bit i of the 32-bit qh."""
    high = (qh[..., :, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., byte i//8, bit i%8]
    return _nibbles(qs) | (high.reshape(*qh.shape[:-1], 32) << 4)


def _q5_0(b: np.ndarray) -> Parts:
    return _q5(b[..., 2:6], b[..., 6:22]) + np.uint8(112), 128, 8, _f16(b, 0), None  # q - 16 + 128


def _q5_1(b: np.ndarray) -> Parts:
    return _q5(b[..., 4:8], b[..., 8:24]) + np.uint8(128), 128, 8, _f16(b, 0), _f16(b, 2)


def _mxfp4(b: np.ndarray) -> Parts:
    """The e2m1 codes (the codebook's indices), scale 2^(e - 128) from the e8m0 byte: ggml's halved
    scale, fp32 subnormal below e = 2."""
    e = b[..., 0:1].astype(np.float64)
    return _nibbles(b[..., 1:17]), 12, 4, np.exp2(e - 128).astype(np.float32), None


CONVERTERS: dict[Q, Callable[[np.ndarray], Parts]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.MXFP4: _mxfp4}
