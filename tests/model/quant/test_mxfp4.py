"""MXFP4 (GGUF type 39: 32 e2m1 values and one e8m0 exponent a block) in the packed format: every
exponent byte (subnormal halves at 0 and 1 included) and every code dequantize to gguf's values bit
for bit, and the packed kernel multiplies them within bounds.py's bound."""

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.formats.packed import dequantize
from tests.model.quant.test_kernel import check


def every_exponent_and_code() -> np.ndarray:
    """One row per exponent byte 0..250 (past it 12 * 2^(e - 128) overflows fp32), each block
    holding every 4-bit code twice, in rows of 2 blocks (64 columns)."""
    codes = np.arange(16, dtype=np.uint8)
    qs = codes | (codes[::-1] << 4)  # 16 bytes: low nibbles 0..15, high 15..0
    rows = []
    for e in range(251):
        block = np.concatenate([[e], qs]).astype(np.uint8)
        rows.append(np.concatenate([block, block[[0, *range(16, 0, -1)]]]))  # the second block's bytes reversed
    return np.stack(rows)


def test_every_exponent_and_code_dequantizes_as_gguf():
    raw = every_exponent_and_code()
    packed = convert(Q.MXFP4, raw, (251, 64))
    want = gguf_dequantize(raw, Q.MXFP4)
    assert np.isfinite(want).all()
    assert np.array_equal(dequantize(packed).numpy().view(np.uint32), want.view(np.uint32))
    assert (packed.bits, packed.group, packed.offset, packed.codebook) == (4, 32, 12, "e2m1")


def test_kernel_within_bound_on_real_exponents():
    """Exponents around gpt-oss's (weights of |w| up to ~8): the integer kernel against the values."""
    raw = every_exponent_and_code()[110:140]
    packed = convert(Q.MXFP4, raw, (30, 64))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    check(packed, x, "int8x2")
