"""The engine's rules for models with recurrent layers (kvgen.engine.recurrent) on Qwen3.5: what the
memory of a sequence comes to, and every path not wired for a state pool refused in one line."""

import json
import shutil

import numpy as np
import pytest

from kvgen import LLM, SamplingParams
from kvgen.cache.sizing import kv_bytes_per_token, plan_kv
from kvgen.cli import main
from kvgen.config import EngineConfig, ModelConfig
from kvgen.engine.recurrent import build_state_pool, recurrent_refusal
from kvgen.errors import InvalidRequestError, ModelLoadError
from tests.loaders.arch_fixtures import arch_checkpoint

CONTEXT = 32768
# Qwen3.5-2B's text config (benchmarks/models.py's qwen35-2b), at a 32k context.
QWEN35_2B = dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, full_attention_interval=4, vocab_size=248320, tie_word_embeddings=True,
                 max_position_embeddings=CONTEXT,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def test_a_qwen35_2b_sequence_at_32k_holds_at_most_a_third_of_full_attention(tmp_path, capsys):
    """KV of its 6 attention layers plus the state of its 18 delta-net layers, as the engine's pools
    are sized, against every layer holding every token's K/V."""
    model = ModelConfig.from_hf(QWEN35_2B)
    config = EngineConfig(max_num_seqs=1, enable_prefix_caching=False, num_kv_blocks=1)
    kv = plan_kv(model, config, CONTEXT).bytes_per_token * CONTEXT
    state = build_state_pool(model, config).bytes_per_sequence
    full = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, 4) * CONTEXT
    assert state == 18 * (16 * 128 * 128 + 3 * (2 * 16 * 128 + 16 * 128)) * 4  # delta-rule state + conv window
    assert 3 * (kv + state) <= full
    (tmp_path / "config.json").write_text(json.dumps(QWEN35_2B))
    assert main(["kv-size", str(tmp_path), "--tokens", str(CONTEXT), "--dtype", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sequence_bytes"] == kv + state and report["full_attention_bytes"] == full


def test_kv_size_of_a_gguf_shows_kv_per_token_and_state_per_sequence_apart(capsys):
    assert main(["kv-size", str(arch_checkpoint("qwen35").gguf), "--tokens", "1000", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "1 attention layers: 512 bytes of KV per token" in out  # 2 x 2 KV heads x 32 x 4 bytes
    assert "3 recurrent layers: 16,896 bytes of state per sequence" in out


@pytest.mark.parametrize("options,needle", [
    ({"kv_cache": "contiguous"}, "--kv-cache paged"),
    ({"kv_cache": "none"}, "--kv-cache paged"),
    ({"device": "cuda"}, "--device cpu"),
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size 1"),
    ({"kv_offload_memory": 1 << 20}, "KV tiers"),
])
def test_paths_without_a_state_pool_are_refused_in_one_line(options, needle):
    model = ModelConfig.from_hf(QWEN35_2B)
    message = recurrent_refusal(model, EngineConfig(**options))
    assert needle in message and "\n" not in message
    assert recurrent_refusal(ModelConfig.from_hf(QWEN35_2B | {"model_type": "qwen3"}), EngineConfig(**options)) is None


def test_the_cli_refuses_them_with_exit_2(capsys):
    path = arch_checkpoint("qwen35").gguf
    assert main(["generate", "--model", str(path), "--kv-cache", "none", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache paged" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("policy", ["window:64", "sinks:4,64", "h2o:8,32"])
def test_cache_policies_that_drop_attention_kv_are_refused(policy):
    llm = LLM(str(arch_checkpoint("qwen35").hf_dir), quantization="none")
    with pytest.raises(InvalidRequestError, match="recurrent layers"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, kv_policy=policy))


def test_a_draft_model_with_recurrent_layers_is_refused():
    qwen35 = str(arch_checkpoint("qwen35").hf_dir)
    with pytest.raises(ValueError, match="draft model qwen35"):
        LLM(str(arch_checkpoint("qwen3").hf_dir), speculative_method="draft", draft_model=qwen35)


def test_a_multimodal_qwen35_moe_says_only_its_text_model_runs(tmp_path):
    """qwen3_5_moe_text runs (tests/loaders/test_moe_models.py); the multimodal wrapper is refused."""
    hf = shutil.copytree(arch_checkpoint("qwen35").hf_dir, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"model_type": "qwen3_5_moe"}))
    with pytest.raises(ModelLoadError) as refused:
        LLM(str(hf))
    assert "qwen3_5_moe_text" in str(refused.value) and "\n" not in str(refused.value)


def test_a_qwen35moe_gguf_says_so_too(tmp_path):
    import gguf

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "qwen35moe")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="its GGUF and multimodal checkpoints are not supported yet"):
        LLM(str(path))


def test_the_start_up_log_and_metrics_show_the_state_pool_apart_from_kv():
    from kvgen.server.metrics import stats_families

    llm = LLM(str(arch_checkpoint("qwen35").hf_dir), quantization="none", enable_prefix_caching=False)
    engine, pool = llm.engine, llm.engine.recurrent.pool
    assert "KV cache:" in engine.capacity_report() and "state pool: " in engine.capacity_report()
    engine.add_request("r", list(range(5, 45)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    values = {s.name: s.value for family in stats_families(engine.stats()) for s in family.samples}
    assert values["kvgen_kv_cache_blocks_used"] == 3  # 40 prompt tokens in the attention layer's blocks
    assert values["kvgen_state_slots_used"] == 1 and values["kvgen_state_slots_total"] == pool.num_slots
    assert values["kvgen_state_bytes_used"] == pool.bytes_per_sequence
    assert values["kvgen_state_bytes_total"] == pool.total_bytes
