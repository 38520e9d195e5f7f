"""gpt-oss's MXFP4 expert tensors read as transformers reads them."""

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kvgen.loaders.experts import dequantize_mxfp4


def test_mxfp4_blocks_hold_transformers_values():
    """Every code in both nibbles, exponents around gpt-oss's: transformers' dequantization (which also
    transposes to [experts, in, out]) gives the same values, bit for bit."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=g)  # [experts, out, G, 16]
    scales = torch.randint(118, 132, (2, 6, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), want.transpose(1, 2))
