"""benchmarks/kquant_rows.py: the K-quant kernel timed alone on a small GGUF's Q4_K and Q6_K matrices."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from benchmarks.kquant_rows import main
from kvgen.model.kernels.kquant import kquant_kernel

pytestmark = pytest.mark.skipif(kquant_kernel() is None, reason="the K-quant kernel needs AVX-512 VNNI")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """Two 48 x 512 matrices of random K-quant blocks (their values do not matter to a timing) and an
    F32 one."""
    path = tmp_path_factory.mktemp("kquant") / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, kind in (("blk.0.ffn_gate.weight", GGMLQuantizationType.Q4_K),
                       ("blk.0.ffn_down.weight", GGMLQuantizationType.Q6_K)):
        block, size = GGML_QUANT_SIZES[kind]
        writer.add_tensor(name, rng.integers(0, 256, (48, 512 // block * size), dtype=np.uint8), raw_dtype=kind)
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((48, 512), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_row_count_and_part_is_timed_on_the_files_k_quant_matrices(small_gguf, capsys):
    results = main([str(small_gguf), "--suffix", "ffn_down.weight", "ffn_gate.weight", "ffn_up.weight", "--rows",
                    "1", "3", "--parts", "1", "2", "--threads", "1", "--repeats", "2"])
    assert [(parts, rows) for parts, rows, _ in results] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(ms > 0 for _, _, ms in results)
    assert "2 matrices, x in 2 part(s), 3 row(s)" in capsys.readouterr().out  # the F32 one is not timed


def test_a_suffix_no_k_quant_tensor_has_is_a_one_line_error(small_gguf):
    with pytest.raises(SystemExit, match="no K-quant tensor .* ends with ffn_up.weight"):
        main([str(small_gguf), "--suffix", "ffn_up.weight"])
