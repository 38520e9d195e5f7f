"""KV memory arithmetic."""

import pytest

from kvgen.cache.sizing import format_bytes, kv_bytes_per_token, num_blocks_for_budget, parse_bytes


def test_llama2_70b_bytes_per_token():
    per_token = kv_bytes_per_token(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert per_token == 327_680
    assert per_token * 100_000 == 32_768_000_000
    assert format_bytes(per_token * 100_000) == "32.8 GB"
    assert format_bytes(per_token * 100_000, binary=True) == "30.5 GiB"


@pytest.mark.parametrize("text, expected", [
    ("1000", 1000),
    ("2GiB", 2 * 1024**3),
    ("2 gib", 2 * 1024**3),
    ("512MB", 512 * 10**6),
    ("512M", 512 * 10**6),
    ("1.5G", 1_500_000_000),
    ("4Ki", 4096),
    ("1TB", 10**12),
    ("0.5KiB", 512),
    ("1e3", 1000),
    ("10 B", 10),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_passes_ints_through():
    assert parse_bytes(123) == 123


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "1.2.3", "12 XB", "lots", "1.5", "0.1KiB"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_num_blocks_for_budget():
    assert num_blocks_for_budget(32_768_000_000, block_size=16, bytes_per_token=327_680) == 6250
    assert num_blocks_for_budget(16 * 327_680 - 1, block_size=16, bytes_per_token=327_680) == 0
    with pytest.raises(ValueError):
        num_blocks_for_budget(-1, 16, 10)
    with pytest.raises(ValueError):
        num_blocks_for_budget(100, 0, 10)


def test_kv_bytes_per_token_rejects_non_positive():
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(1, 0, 64, 2)


@pytest.mark.parametrize("n, binary, expected", [
    (0, False, "0 B"),
    (999, False, "999 B"),
    (1000, False, "1.0 KB"),
    (1023, True, "1023 B"),
    (1536, True, "1.5 KiB"),
    (999_960, False, "1.0 MB"),
    (2 * 1024**3, True, "2.0 GiB"),
    (10**18, False, "1000.0 PB"),
])
def test_format_bytes(n, binary, expected):
    assert format_bytes(n, binary) == expected


def _model(**overrides):
    from kvgen.config import ModelConfig

    return ModelConfig(**({"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_layers": 6,
                           "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 1024}
                          | overrides))


def test_kv_plan_of_one_pool():
    from kvgen.cache.sizing import plan_kv
    from kvgen.config import EngineConfig

    model = _model()
    per_token = kv_bytes_per_token(6, 2, 16, 4)  # float32 pools
    plan = plan_kv(model, EngineConfig(max_num_seqs=2, block_size=16), max_model_len=1024)
    assert plan.bytes_per_token == per_token and plan.kinds == ()
    assert plan.blocks == (2 * 1024 // 16,)  # two full-length sequences, under the default budget
    assert plan.capacity_tokens == 2048 and plan.manager(True, 512).num_blocks == 128
    budget = plan_kv(model, EngineConfig(kv_cache_memory=100 * 16 * per_token + 1), max_model_len=1024)
    assert budget.blocks == (100,) and plan_kv(model, EngineConfig(num_kv_blocks=7), 1024).blocks == (7,)
    assert "128 blocks x 16 tokens = 2048 tokens" in plan.report()
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv(model, EngineConfig(kv_cache_memory=16 * per_token - 1), max_model_len=1024)


def test_kv_plan_of_a_hybrid_model_splits_the_budget_so_the_kinds_run_out_together():
    from kvgen.cache.hybrid import HybridKVManager
    from kvgen.cache.sizing import plan_kv
    from kvgen.config import EngineConfig

    model = _model(layer_windows=(64, 64, None, 64, 64, None))
    plan = plan_kv(model, EngineConfig(max_num_seqs=4, block_size=16, max_num_batched_tokens=64), 1024)
    assert [k.window for k in plan.kinds] == [None, 64] and plan.kinds[1].layers == (0, 1, 3, 4)
    # a 1024-token sequence holds 1024 tokens in the global pool, 64 + 64 + 2 * 16 in the windowed one
    assert plan.blocks == (4 * 1024 // 16, 4 * 160 // 16)
    assert isinstance(plan.manager(True, 64), HybridKVManager) and plan.report().startswith("hybrid KV cache: ")
