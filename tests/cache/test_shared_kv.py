"""kvgen.cache.shared_kv: Gemma 4's sharing layers read the donors transformers gives them, and a Gemma 4
E2B-shaped sequence's KV at 8k is the donors' share (the sharing layers add nothing), measured from
PagedKVCache pools of the holders on the meta device."""

import pytest
import torch

from kvgen.cache.shared_kv import FULL, SLIDING, SharedKVShape, kv_donors

# Gemma 4 E2B's text config as its config.json gives it (the sizes that matter here; transcribed from
# copies of the file, several agreeing): 35 layers, 4 sliding : 1 full, the last 20 sharing.
E2B = {"model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8,
       "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
       "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256,
       "layer_types": ([SLIDING] * 4 + [FULL]) * 7}
TOKENS = 8 * 1024


@pytest.mark.parametrize("config", [
    E2B, {"num_hidden_layers": 6, "num_kv_shared_layers": 2,
          "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]}], ids=["E2B", "fixture"])
def test_donors_are_transformers(config):
    from transformers import Gemma4TextConfig

    hf = Gemma4TextConfig(num_hidden_layers=config["num_hidden_layers"], layer_types=config["layer_types"],
                          num_kv_shared_layers=config["num_kv_shared_layers"])
    donors = kv_donors(config["layer_types"], config["num_kv_shared_layers"])
    modes = hf.kv_sharing_modes
    for i, mode in enumerate(modes):
        if mode == "reuse":  # reads the "store" layer of its kind
            stores = [j for j, m in enumerate(modes) if m == "store" and hf.layer_types[j] == hf.layer_types[i]]
            assert donors[i] == stores[0] != i
        else:
            assert donors[i] == i
    print(f"\n{donors}")


def test_e2b_donors_and_refusals():
    donors = kv_donors(E2B["layer_types"], 20)
    assert donors[:15] == list(range(15)) and set(donors[15:]) == {13, 14}
    assert kv_donors([SLIDING, FULL], 0) == [0, 1]
    with pytest.raises(ValueError, match="no earlier layer"):
        kv_donors([SLIDING, SLIDING, FULL], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e2b_kv_at_8k_is_the_donors_share(dtype):
    from kvgen.model.kv_storage import PagedKVCache

    shape = SharedKVShape.from_hf_config({"text_config": E2B})
    size = torch.empty(0, dtype=dtype).element_size()
    report = shape.report(TOKENS, size)
    print(f"\n{report}")
    holders = shape.holders()
    assert holders == list(range(15)) and report["holders_by_kind"] == {SLIDING: 12, FULL: 3}
    held = {SLIDING: min(TOKENS, 512), FULL: TOKENS}  # a window layer keeps its window, a full one every token
    layer_bytes = [held[kind] * shape.kind_bytes_per_token(kind, size) for kind in E2B["layer_types"]]
    assert report["kv_bytes_unshared"] == sum(layer_bytes)
    assert report["kv_bytes"] == sum(layer_bytes[:15])  # the donors' share: the 20 sharing layers add nothing
    # measured from pools: one per kind for the holders, each sized for one sequence of TOKENS
    # (the sliding kind for its window, as kvgen.cache.hybrid sizes a windowed kind)
    block = 16
    pools = {SLIDING: PagedKVCache(12, 512 // block, block, 1, 256, torch.device("meta"), dtype),
             FULL: PagedKVCache(3, TOKENS // block, block, 1, 512, torch.device("meta"), dtype)}
    measured = sum(sum(t.numel() * t.element_size() for t in p.k + p.v) // (p.num_blocks + 1) * p.num_blocks
                   for p in pools.values())  # less the pool's one scratch block
    assert measured == report["kv_bytes"]
    # with the block slack the hybrid pool keeps for a window straddling blocks
    assert shape.sequence_bytes(TOKENS, size, block_size=block) - report["kv_bytes"] == 12 * block * \
        shape.kind_bytes_per_token(SLIDING, size)


def test_kv_size_prints_the_holders_only(tmp_path, capsys):
    import json

    from kvgen.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": E2B}))
    assert main(["kv-size", str(tmp_path), "--tokens", str(TOKENS), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "35 layers, 20 of them reading an earlier layer's K/V: 15 hold K/V (12 sliding, 3 full)" in out
    assert "56,623,104 bytes" in out and "42.9%" in out
