"""The bench's generated checkpoints: names, shards, and llama.cpp's own GGUF files of them."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from benchmarks import llama_tools, models, random_models
from kvgen.loaders import load_model
from kvgen.loaders.gguf_reader import read_gguf
from kvgen.model.decoder import DecoderModel
from kvgen.paths import cache_root
from kvgen.phases import prefill
from tests.bench.test_bench import TINY_ARCH

# K-quant rows are 256 weights long; llama-quantize falls back to other types for shorter ones.
KQUANT_ARCH = TINY_ARCH | dict(hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("name, want", [
    ("llama-1b", ("llama-1b", None)), ("llama-1b:Q4_K_M", ("llama-1b", "Q4_K_M")),
    ("llama-3b:q6_k", ("llama-3b", "Q6_K")), ("smollm2-135m:Q8_0", ("smollm2-135m", "Q8_0")),
    ("org/repo:Q4_K_M", None), ("model.gguf", None), (None, None), ("stories260k", None),
])
def test_model_names(name, want):
    assert models.parse_name(name) == want


def test_an_unknown_mix_names_the_ones_there_are():
    with pytest.raises(ValueError, match=r"llama-1b:Q3_K_S: unknown quantization mix 'Q3_K_S'; the bench makes "
                                         r"Q4_K_M, Q4_0, Q5_K_M, Q6_K, Q8_0, MXFP4_MOE, BF16"):
        models.resolve("llama-1b:Q3_K_S")


def test_the_1b_and_3b_shapes_are_llama_3_2s():
    from transformers import LlamaConfig

    for name, (hidden, layers, heads) in {"llama-1b": (2048, 16, 32), "llama-3b": (3072, 28, 24)}.items():
        config = LlamaConfig(**models.ARCHITECTURES[name])
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (hidden, layers, heads)
        assert (config.intermediate_size, config.num_key_value_heads, config.vocab_size) == (8192, 8, 128256)
        assert config.tie_word_embeddings and config.head_dim == (64 if name == "llama-1b" else 128)
        assert config.rope_parameters["rope_theta"] == 500000.0 and config.rope_parameters["rope_type"] == "default"


def test_a_checkpoint_written_in_shards_loads_as_transformers_built_it(tmp_path, monkeypatch):
    """Shards of at most SHARD_BYTES with their index; transformers and kvgen read the same logits."""
    monkeypatch.setattr(random_models, "SHARD_BYTES", 30_000)
    path = tmp_path / "hf"
    models.build_random_model(TINY_ARCH | dict(dtype="bfloat16"), 0, path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shards) > 2 and set(index.values()) == set(shards) and "lm_head.weight" not in index
    hf = models.load_hf_model(models.BenchModel("hf", path), torch.float32)
    assert hf.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    ids = [5, 17, 99, 3, 250, 42]
    want = hf(torch.tensor([ids])).logits[0, -1]
    loaded = load_model(path)
    got, _ = prefill(DecoderModel(loaded.config, loaded.weights), ids, "none")
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.slow  # llama.cpp's converter and llama-quantize: 10-20 s
def test_a_quantized_name_is_the_file_llama_cpp_makes(tmp_path, monkeypatch):
    """NAME:Q4_K_M: converted to BF16 by convert_hf_to_gguf.py, then quantized by llama-quantize (Q4_K
    with Q6_K for some v/down and the tied embedding), cached, and read by kvgen as the same model."""
    converter = llama_tools.converter_dir(cache_root())  # this machine's copy, not a download per run
    (tmp_path / converter.name).symlink_to(converter)
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(models.ARCHITECTURES, "tiny", KQUANT_ARCH)
    model = models.resolve("tiny:Q4_K_M")
    assert model.path == model.gguf == tmp_path / "bench-models" / "tiny-seed0-gguf" / "tiny-Q4_K_M.gguf"
    types = {t.name: t.tensor_type for t in read_gguf(model.path).tensors}
    assert types["token_embd.weight"] == QType.Q6_K and types["blk.0.attn_q.weight"] == QType.Q4_K
    assert "output.weight" not in types and (model.path.parent / "tiny-BF16.gguf").is_file()
    stamp = model.path.stat().st_mtime_ns
    assert models.resolve("tiny:q4_k_m").path.stat().st_mtime_ns == stamp
    config = load_model(model.path).config
    assert (config.hidden_size, config.num_layers, config.vocab_size, config.tie_word_embeddings) == (256, 2, 320, True)


@pytest.mark.slow  # llama.cpp's converter and llama-quantize: ~25 s
def test_a_qwen35_shape_is_made_by_llama_cpps_converter(tmp_path, monkeypatch):
    """A family other than Llama: Qwen3.5's model saved by its transformers class, converted with
    `--no-mtp` and Qwen2's real vocabulary (padded by the converter to the config's), then quantized."""
    converter = llama_tools.converter_dir(cache_root())
    (tmp_path / converter.name).symlink_to(converter)
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    tiny = dict(models.ARCHITECTURES["qwen35-0.8b"], hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                vocab_size=152064)
    monkeypatch.setitem(models.ARCHITECTURES, "tiny35", tiny)
    reader = read_gguf(models.resolve("tiny35:Q4_K_M").path)
    assert reader.metadata["general.architecture"] == "qwen35"
    assert len(reader.metadata["tokenizer.ggml.tokens"]) == 152064
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ssm_out.weight"] == QType.Q4_K and "blk.3.attn_gate.weight" not in types
    assert types["blk.3.attn_q.weight"] == QType.Q4_K and types["blk.0.ssm_a"] == QType.F32


@pytest.mark.slow  # llama.cpp's converter and llama-quantize: ~30 s
def test_a_gemma4_shape_is_made_by_llama_cpps_converter(tmp_path, monkeypatch):
    """Gemma 4's model saved by its transformers class, converted with the placeholder vocabulary as a
    tokenizer.json (the only form its converter reads), quantized; kvgen reads the layers that share K/V."""
    converter = llama_tools.converter_dir(cache_root())
    (tmp_path / converter.name).symlink_to(converter)
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    tiny = dict(models.ARCHITECTURES["gemma4-e2b"], hidden_size=256, intermediate_size=512, num_hidden_layers=10,
                layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2, num_kv_shared_layers=2,
                vocab_size=1024, vocab_size_per_layer_input=1024)
    monkeypatch.setitem(models.ARCHITECTURES, "tiny4", tiny)
    path = models.resolve("tiny4:Q4_K_M").path
    reader = read_gguf(path)
    assert reader.metadata["general.architecture"] == "gemma4"
    assert reader.metadata["gemma4.attention.shared_kv_layers"] == 2
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "blk.9.attn_k.weight" not in types and types["blk.0.attn_q.weight"] == QType.Q4_K
    config = load_model(path).config
    assert config.kv_holders == list(range(8)) and config.layer_head_dims == ((256,) * 4 + (512,)) * 2
    assert config.double_wide_mlp and config.per_layer_input_size == 256
