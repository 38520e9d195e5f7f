"""GGUF blocks -> PackedWeight keeps every value: equal to gguf's own dequantization, bit for bit."""

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from kvgen.model.formats import gguf_blocks
from kvgen.model.formats.packed import concat_rows, dequantize, dequantize_rows
from kvgen.model.formats.gguf_blocks import convert
from tests.model.quant.raw_blocks import MAPPED, Q, raw_matrix


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
@pytest.mark.parametrize("out", [6, 8])  # 6: the last tile of 4 rows is half padding
def test_conversion_equals_gguf_dequantization(ggml_type, out):
    raw = raw_matrix(ggml_type, out, 512)
    packed = convert(ggml_type, raw, (out, 512))
    want = gguf_dequantize(raw, ggml_type)
    got = dequantize(packed).numpy()
    assert got.shape == want.shape == (out, 512)
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, signed zeros too


@pytest.mark.parametrize("ggml_type, bits, group, scale_dtype", [
    (Q.Q4_0, 4, 32, torch.float16), (Q.Q4_1, 4, 32, torch.float16), (Q.Q4_K, 4, 32, torch.float32),
    (Q.Q8_0, 8, 32, torch.float16), (Q.Q5_0, 8, 32, torch.float16), (Q.Q5_1, 8, 32, torch.float16),
    (Q.Q5_K, 8, 32, torch.float32), (Q.Q6_K, 8, 16, torch.float32), (Q.Q3_K, 8, 16, torch.float32),
    (Q.Q2_K, 8, 16, torch.float32),
], ids=lambda v: getattr(v, "name", str(v)))
def test_each_type_gets_its_kernel_format(ggml_type, bits, group, scale_dtype):
    """The module docstring's table: 4-bit types stay 4-bit, and scales stay fp16 where gguf's are.
    The 4 rows are padded to a panel of 16."""
    packed = convert(ggml_type, raw_matrix(ggml_type, 4, 256), (4, 256))
    assert (packed.bits, packed.group, packed.scale.dtype) == (bits, group, scale_dtype)
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() == 16 * 256 * bits // 8


def test_types_without_a_kernel_format_are_left_to_the_caller():
    raw = np.zeros((2, 64), np.uint8)  # F16 [2, 32]
    assert convert(Q.F16, raw, (2, 32)) is None
    assert convert(Q.IQ4_NL, np.zeros((2, 18), np.uint8), (2, 32)) is None


def test_without_a_built_packer_the_c_packed_types_are_left_to_the_caller(monkeypatch):
    """Where block_pack.c does not build (no C compiler) Q4_0... are dequantized by the caller, as
    types without a kernel format are; the K-quants still convert in numpy."""
    monkeypatch.setattr(gguf_blocks, "block_packer", lambda: None)
    assert convert(Q.Q4_0, raw_matrix(Q.Q4_0, 4, 64), (4, 64)) is None
    assert convert(Q.Q4_K, raw_matrix(Q.Q4_K, 4, 256), (4, 256)) is not None


def test_blocks_of_the_wrong_shape_are_refused():
    raw = raw_matrix(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="Q8_0 blocks of shape"):
        convert(Q.Q8_0, raw, (4, 96))


def test_fused_projections_stack_the_parts_exactly():
    """q/k/v of different heights (6 rows: a padded tile in the middle) become one matrix."""
    parts = [convert(Q.Q4_1, raw_matrix(Q.Q4_1, out, 64, seed=out), (out, 64)) for out in (8, 6, 6)]
    fused = concat_rows(parts)
    assert fused.shape == (20, 64) and fused.scale.dtype == torch.float16
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    k_quant = [convert(Q.Q4_K, raw_matrix(Q.Q4_K, 4, 256, seed=s), (4, 256)) for s in (1, 2)]
    assert concat_rows(k_quant).scale.dtype == torch.float32
    with pytest.raises(ValueError, match="different formats"):
        concat_rows([parts[0], convert(Q.Q8_0, raw_matrix(Q.Q8_0, 4, 64), (4, 64))])


@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_embedding_rows_dequantize_alone(ggml_type):
    packed = convert(ggml_type, raw_matrix(ggml_type, 10, 256), (10, 256))
    rows = torch.tensor([9, 0, 3, 3, 8])  # the last tile is half padding; repeats allowed
    assert torch.equal(dequantize_rows(packed, rows), dequantize(packed)[rows])
