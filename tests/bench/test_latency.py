"""`kvgen bench latency`'s roofline: the bytes a decode step reads, counted independently here."""

from __future__ import annotations

import json

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from kvgen.bench.latency import gguf_matmul_bytes, step_bytes
from kvgen.cli import main
from kvgen.config import ModelConfig
from tests.loaders.gguf_builder import Dims, llama_vocab, random_model, write_gguf

DIMS = Dims()  # hidden 256, MLP 512, 2 layers, 4 heads over 2 KV heads (head size 64)


@pytest.fixture(scope="module")
def vocab(stories_dir):
    return llama_vocab(stories_dir)


def stored_bytes(qtype: QType, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return rows * cols // block * size


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_step_reads_every_matrix_once_as_stored(tmp_path, vocab, tied):
    """q, k, v, o, gate, up, down per layer and the head: the embedding only where it is the head."""
    model = random_model(QType.Q8_0, len(vocab.tokens), DIMS)
    if tied:
        del model["lm_head.weight"]
    h, i, v, kv_rows = DIMS.hidden, DIMS.inter, len(vocab.tokens), DIMS.kv_heads * DIMS.hidden // DIMS.heads
    per_layer = [(h, h), (kv_rows, h), (kv_rows, h), (h, h), (i, h), (i, h), (h, i)]
    want = DIMS.layers * sum(stored_bytes(QType.Q8_0, r, c) for r, c in per_layer) + stored_bytes(QType.Q8_0, v, h)
    assert gguf_matmul_bytes(write_gguf(tmp_path / "m.gguf", model, vocab)) == want


def test_kv_bytes_at_the_mean_context():
    """2 (K and V) x layers x KV heads x head size x element bytes, at prompt + half the new tokens."""
    config = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    assert step_bytes(1000, config, "bfloat16", 100 + 64 / 2) == {"weights": 1000, "kv_average": 2 * 2 * 2 * 64 * 2 * 132}
    assert step_bytes(0, config, "float32", 10)["kv_average"] == 2 * 2 * 2 * 64 * 4 * 10


def test_each_system_is_measured_against_its_own_bytes(tmp_path, capsys):
    """kvgen's packed weights and KV dtype, llama.cpp's file and F16 KV; GB/s = bytes x tokens/s, and
    its share of the bandwidth this run measured."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # installed without its library (LLAMA_CPP_LIB_PATH unset): FileNotFoundError
        pytest.skip(f"llama-cpp-python cannot load: {e}")
    argv = ["bench", "latency", "--model", "stories260k", "--threads", "1", "--prompt-len", "16", "--gen-len", "8",
            "--repeats", "1", "--bandwidth-size", "64MiB", "--compare", "llama.cpp", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "latency.json").read_text())
    settings, results = data["settings"], data["results"]
    config = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_layers=5, num_heads=8,
                         num_kv_heads=4, head_dim=8, max_position_embeddings=512)  # stories260K
    context = settings["prompt_len"] + settings["gen_len"] / 2
    peer_gguf = data["decode_bytes_per_token_by_system"]["llama.cpp"]["weights"]
    assert results["llama.cpp"]["bytes_per_token"] == peer_gguf + step_bytes(0, config, "float16", context)["kv_average"]
    assert results["kvgen"]["bytes_per_token"] == (data["decode_bytes_per_token"]["weights"]
                                                   + step_bytes(0, config, "float32", context)["kv_average"])
    for result in results.values():
        assert result["decode_bytes_per_s"] == pytest.approx(result["bytes_per_token"] * result["decode_tokens_per_s"])
        assert result["bandwidth_fraction"] == pytest.approx(result["decode_bytes_per_s"]
                                                             / data["memory_bandwidth_bytes_per_s"])
        assert result["load_s"] > 0
    assert data["memory_bandwidth_method"] == "read"
    out = capsys.readouterr().out
    assert "streaming read of 64.0 MiB" in out and "llama.cpp: a decode step reads" in out and "kvgen load:" in out
