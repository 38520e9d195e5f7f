"""kvgen.cache.state_sizing: KV bytes per token and state bytes per sequence of a Qwen3.5 model, apart,
and issue 42's memory claim: at 32k context a Qwen3.5-2B-shaped sequence's cache (KV of its 6 attention
layers + the state of its 18 Gated DeltaNet layers) is at most 1/3 of what full attention on all 24
layers would hold. The figures are checked against the pools themselves (kvgen's PagedKVCache and
StatePool, on the meta device: their tensors' bytes, nothing allocated)."""

import json

import pytest
import torch

from kvgen.cache.state_pool import StatePool
from kvgen.cache.state_sizing import HybridShape, hybrid_shape_of, state_bytes_per_sequence
from kvgen.config import RecurrentShape

# The text configs of Qwen/Qwen3.5-2B and Qwen/Qwen3.5-0.8B as their config.json gives them (the sizes that
# matter here; transcribed from copies of the files, several agreeing). The 4B / 9B shapes have 32 value heads.
QWEN35_2B = {"model_type": "qwen3_5_text", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 6144, "full_attention_interval": 4,
             "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
QWEN35_0_8B = QWEN35_2B | {"hidden_size": 1024, "intermediate_size": 3584}
CONTEXT = 32 * 1024


def test_shape_from_the_config():
    shape = HybridShape.from_hf_config({"text_config": QWEN35_2B, "model_type": "qwen3_5"})
    assert (shape.attention_layers, shape.recurrent_layers) == (6, 18)
    assert (shape.kv_heads, shape.head_dim) == (2, 256)
    assert shape.recurrent == RecurrentShape(16, 16, 128, 128, 4)
    assert shape.recurrent.conv_dim == 2 * 16 * 128 + 16 * 128
    # transformers' own config (layer_types spelled out) gives the same
    from transformers import Qwen3_5TextConfig

    saved = Qwen3_5TextConfig(**{k: v for k, v in QWEN35_2B.items() if k != "model_type"}).to_dict()
    assert "layer_types" in saved and HybridShape.from_hf_config(saved) == shape


def test_bytes_are_the_pools_bytes():
    """KV per token from a PagedKVCache of the attention layers, state per sequence from a StatePool of
    the recurrent layers, both on the meta device."""
    from kvgen.model.kv_storage import PagedKVCache

    shape = HybridShape.from_hf_config(QWEN35_2B)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        kv = PagedKVCache(shape.attention_layers, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=256,
                          device=torch.device("meta"), dtype=dtype)
        slots = kv.k[0].shape[1]
        kv_bytes = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
        assert kv_bytes // slots == shape.kv_bytes_per_token(size)
    pool = StatePool(shape.recurrent, shape.recurrent_layers, num_slots=3, device="meta")
    per_slot = (pool.conv.numel() + pool.states.numel()) * 4 // 3
    assert per_slot == shape.state_bytes_per_sequence() == pool.bytes_per_sequence
    assert per_slot == 18 * (6144 * 3 * 4 + 16 * 128 * 128 * 4)  # 20.2 MB: 1.05 MB of state a layer


@pytest.mark.parametrize("config", [QWEN35_2B, QWEN35_0_8B], ids=["2B", "0.8B"])
@pytest.mark.parametrize("kv_bytes", [4, 2], ids=["fp32 KV", "bf16 KV"])
def test_a_32k_sequence_holds_at_most_a_third_of_full_attention(config, kv_bytes):
    shape = HybridShape.from_hf_config(config)
    report = shape.report(CONTEXT, kv_dtype_bytes=kv_bytes)
    print(f"\n{json.dumps(report)}")
    assert report["sequence_bytes"] == CONTEXT * shape.kv_bytes_per_token(kv_bytes) + shape.state_bytes_per_sequence()
    assert report["full_attention_bytes"] == CONTEXT * 24 * 2 * 2 * 256 * kv_bytes
    assert report["ratio"] <= 1 / 3
    # where it stops holding: the state is fixed, so short sequences pay relatively more
    crossover = shape.state_bytes_per_sequence() / ((1 / 3) * 24 * 4 * 256 * kv_bytes - 6 * 4 * 256 * kv_bytes)
    assert shape.report(int(crossover) + 1, kv_bytes)["ratio"] <= 1 / 3 < shape.report(int(crossover) - 1, kv_bytes)["ratio"]


def test_state_bytes_scale_with_layers_and_dtype():
    r = RecurrentShape(2, 4, 8, 16, 3)
    assert r.bytes() == (2 * 2 * 8 + 4 * 16) * 2 * 4 + 4 * 8 * 16 * 4
    assert state_bytes_per_sequence(r, 5, state_bytes=2, conv_bytes=2) == 5 * r.bytes(2, 2)
    with pytest.raises(ValueError):
        RecurrentShape(3, 4, 8, 8)


def test_kv_size_prints_state_apart(tmp_path, capsys):
    from kvgen.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN35_2B))
    assert hybrid_shape_of(tmp_path) == hybrid_shape_of(tmp_path / "config.json") == HybridShape.from_hf_config(QWEN35_2B)
    assert main(["kv-size", str(tmp_path), "--tokens", str(CONTEXT), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "6 attention layers: 24,576 bytes of KV per token" in out
    assert "18 recurrent layers: 20,201,472 bytes of state per sequence" in out
    assert main(["kv-size", str(tmp_path), "--tokens", str(CONTEXT), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float16" and report["ratio"] <= 1 / 3
    with capsys.disabled():
        print(f"\n{out}")


def test_a_qwen35_moe_directory_is_sized_as_hybrid_too(tmp_path):
    """Qwen3.5-MoE's layers are Qwen3.5's: 1 of the fixture's 4 keeps KV, 3 a state (its config.json as
    transformers writes it; sizing reads nothing else)."""
    import transformers

    from tests.loaders.arch_fixtures import SPECS

    spec = SPECS["qwen35moe"]
    getattr(transformers, spec.config_cls)(**spec.config).save_pretrained(tmp_path)
    shape = hybrid_shape_of(tmp_path)
    assert (shape.attention_layers, shape.recurrent_layers, shape.recurrent) == (1, 3, RecurrentShape(2, 4, 16, 16, 4))
