"""benchmarks/kquant_rows.py: the K-quant kernel timed alone on a small Q4_K_M-style GGUF's matrices."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.kquant_rows import main
from kvgen.model.kernels import kquant
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
    assert [(parts, rows) for parts, rows, _, _ in results] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(ms > 0 and baseline is None for _, _, ms, baseline in results)
    assert "2 matrices, x in 2 part(s), 3 row(s)" in capsys.readouterr().out  # the F32 norm is not timed


def test_a_baseline_build_is_timed_beside_and_its_bits_compared(small_gguf, tmp_path, capsys):
    """The baseline: this kquant.c with its second part's sums dropped, which changes two-part results."""
    kernels = Path(kquant.__file__).parent
    for header in ("qvec.h", "kquant_dots.h"):
        shutil.copy(kernels / header, tmp_path)
    source = (kernels / "kquant.c").read_text()
    (tmp_path / "kquant.c").write_text(source.replace("out[t * ldo + n] = y[2 * t * N + n] + y[(2 * t + 1) * N + n];",
                                                      "out[t * ldo + n] = y[2 * t * N + n];"))
    results = main([str(small_gguf), "--suffix", "blk.0.ffn_gate.weight", "--rows", "3", "--parts", "1", "2",
                    "--threads", "1", "--repeats", "2", "--baseline", str(tmp_path)])
    assert all(ms > 0 and baseline > 0 for _, _, ms, baseline in results)
    lines = capsys.readouterr().out.splitlines()
    assert "1 part(s)" in lines[0] and lines[0].endswith("the same bits)")
    assert "2 part(s)" in lines[1] and lines[1].endswith("different bits)")


def test_a_suffix_no_k_quant_tensor_has_is_a_one_line_error(small_gguf):
    with pytest.raises(SystemExit, match="no K-quant tensor .* ends with attn_norm.weight"):
        main([str(small_gguf), "--suffix", "attn_norm.weight"])
