"""The C packer of Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4 blocks (block_pack.c) writes the numpy oracle's bytes
(block_oracle.py: each block's fields, then formats.pack), codes, scales and mins."""

import numpy as np
import pytest
import torch

from kvgen.model.kernels.block_pack import BLOCK_TYPES, block_packer
from kvgen.model.formats.packed import PackedWeight
from tests.model.quant.block_oracle import pack_blocks
from tests.model.quant.raw_blocks import Q, random_blocks, raw_matrix
from tests.support.torch_threads import torch_threads

needs_packer = pytest.mark.skipif(block_packer() is None, reason="no C compiler: block_pack.c does not build")


def assert_same(got: PackedWeight, want: PackedWeight) -> None:
    assert ((got.offset, got.bits, got.group, got.shape, got.codebook)
            == (want.offset, want.bits, want.group, want.shape, want.codebook))
    assert got.scale.dtype == want.scale.dtype and (got.min is None) == (want.min is None)
    for a, b in [(got.codes, want.codes), (got.scale, want.scale)] + ([] if got.min is None else [(got.min, want.min)]):
        assert a.shape == b.shape and np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8))


@needs_packer
@pytest.mark.parametrize("ggml_type", list(BLOCK_TYPES), ids=lambda t: t.name)
def test_packer_writes_the_oracles_bytes(ggml_type):
    """Random blocks (every code and 5th-bit pattern): matrices with a ragged last panel, one whole
    panel and fewer rows than a panel; gguf's quantization of normal weights; and a stack of a
    row-permuted copy and a view of whole rows (q/k/v, gate/up) whose panels straddle the parts,
    packed in one call with two threads."""
    pack = block_packer().pack
    for out, cols, seed in ((37, 512, 0), (16, 32, 1), (5, 96, 2)):
        raw = random_blocks(ggml_type, out, cols, seed)
        assert_same(pack(ggml_type, [raw]), pack_blocks(ggml_type, raw))
    raw = raw_matrix(ggml_type, 20, 256, 3)
    assert_same(pack(ggml_type, [raw]), pack_blocks(ggml_type, raw))
    first, second = random_blocks(ggml_type, 20, 128, 4), random_blocks(ggml_type, 30, 128, 5)
    order = np.random.default_rng(6).permutation(20)
    with torch_threads(2):
        got = pack(ggml_type, [first[order], second[3:12]])
    assert_same(got, pack_blocks(ggml_type, np.concatenate([first[order], second[3:12]])))


@needs_packer
def test_packer_refuses_other_types_and_wrong_widths():
    pack = block_packer().pack
    with pytest.raises(ValueError, match="Q4_0/Q4_1"):
        pack(Q.Q4_K, [random_blocks(Q.Q4_K, 4, 256)])
    with pytest.raises(ValueError, match="Q4_0/Q4_1"):
        pack(Q.Q8_0, [random_blocks(Q.Q8_0, 4, 64), random_blocks(Q.Q8_0, 4, 96)])
    with pytest.raises(ValueError, match="Q4_0/Q4_1"):
        pack(Q.Q5_1, [random_blocks(Q.Q5_1, 4, 64)[:, :30]])
