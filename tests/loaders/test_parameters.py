"""Total and active parameter counts: Qwen3-30B-A3B's published figures from its config alone, and
`kvgen kv-size` printing them for a mixture."""

import json

from kvgen.cli import main
from kvgen.config import ModelConfig
from kvgen.loaders.parameters import describe_parameters, parameter_counts

QWEN3_30B_A3B = {  # its config.json, the fields kvgen reads
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


def test_qwen3_30b_a3b_is_30_5b_total_3_3b_active():
    total, active = parameter_counts(ModelConfig.from_hf(QWEN3_30B_A3B))
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9  # Qwen's model card: 30.5B, 3.3B activated
    assert "30.53B total, 3.35B active per token (8 of 128 experts" in describe_parameters(
        ModelConfig.from_hf(QWEN3_30B_A3B))


def test_a_dense_model_is_all_active():
    dense = dict(QWEN3_30B_A3B, model_type="qwen3")
    total, active = parameter_counts(ModelConfig.from_hf(dense))
    assert total == active and "active" not in describe_parameters(ModelConfig.from_hf(dense))


def test_kv_size_prints_total_and_active(arch_ckpt, capsys):
    path = arch_ckpt("olmoe").gguf
    assert main(["kv-size", str(path), "--tokens", "10"]) == 0
    assert "active per token (4 of 8 experts a layer" in capsys.readouterr().out
    assert main(["kv-size", str(path), "--tokens", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters_active"] < report["parameters_total"]


def test_the_start_up_report_says_total_and_active(arch_ckpt):
    from kvgen import LLM

    report = LLM(arch_ckpt("qwen3moe").hf_dir, quantization="none").engine.capacity_report()
    assert report.splitlines()[-1].startswith("parameters: ") and "(2 of 8 experts a layer" in report
