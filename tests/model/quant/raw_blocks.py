"""Small GGUF matrices in every type the quantized kernels map, built the way gguf writes them."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

Q = GGMLQuantizationType
# gguf's Python package quantizes these; the K-quants it only dequantizes.
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.MXFP4]
# Where each K-quant block keeps its fp16 super-block scales (d, and dmin where it has one).
K_SCALE_FIELDS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q3_K: [108], Q.Q2_K: [80, 82]}
MAPPED = QUANTIZABLE + list(K_SCALE_FIELDS)
# Where the others keep their fp16 scale d (and min m).
SCALE_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.MXFP4: [], **K_SCALE_FIELDS}


def raw_matrix(ggml_type: Q, out: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, bytes per row]: gguf's quantization of N(0, 1) weights, or for a K-quant random
    blocks (every bit pattern of codes and sub-block scales is valid) with finite fp16 scales."""
    if ggml_type in QUANTIZABLE:
        return quantize(np.random.default_rng(seed).standard_normal((out, cols)).astype(np.float32), ggml_type)
    return random_blocks(ggml_type, out, cols, seed)


def random_blocks(ggml_type: Q, out: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, bytes per row] of random blocks (every bit pattern of codes and sub-block scales)
    with finite fp16 scales (MXFP4: any exponent byte), of any type in SCALE_FIELDS."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (out, cols // block_size, type_size), dtype=np.uint8)
    for at in SCALE_FIELDS[ggml_type]:
        d = (rng.standard_normal((out, cols // block_size, 1)) * 0.01).astype(np.float16)
        blocks[..., at:at + 2] = d.view(np.uint8)
    return blocks.reshape(out, -1)
