"""benchmarks/kquant_rows.py: the K-quant kernel timed alone on a small Q4_K_M-style GGUF's matrices."""

from __future__ import annotations

import pytest

from benchmarks.kquant_rows import main
from kvgen.model.kernels.kquant import kquant_kernel
from tests.loaders.gguf_builder import Dims, llama_vocab, q4_k_m_style_model, write_gguf

pytestmark = pytest.mark.skipif(kquant_kernel() is None, reason="the K-quant kernel needs AVX-512 VNNI")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory, stories_dir):
    """Q4_K gate and Q6_K down matrices beside F32 norms (gguf_builder's Q4_K_M mix)."""
    vocab = llama_vocab(stories_dir)
    return write_gguf(tmp_path_factory.mktemp("kquant") / "mixed.gguf",
                      q4_k_m_style_model(len(vocab.tokens), Dims()), vocab)


def test_every_row_count_and_part_is_timed_on_the_files_k_quant_matrices(small_gguf, capsys):
    results = main([str(small_gguf), "--suffix", "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight",
                    "blk.0.attn_norm.weight", "--rows", "1", "3", "--parts", "1", "2", "--threads", "1",
                    "--repeats", "2"])
    assert [(parts, rows) for parts, rows, _ in results] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(ms > 0 for _, _, ms in results)
    assert "2 matrices, x in 2 part(s), 3 row(s)" in capsys.readouterr().out  # the F32 norm is not timed


def test_a_suffix_no_k_quant_tensor_has_is_a_one_line_error(small_gguf):
    with pytest.raises(SystemExit, match="no K-quant tensor .* ends with attn_norm.weight"):
        main([str(small_gguf), "--suffix", "attn_norm.weight"])
