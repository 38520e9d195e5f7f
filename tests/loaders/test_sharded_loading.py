"""`load_model(..., shard=(rank, world))`: each format hands over exactly the plan's slices of its
tensors (safetensors read through get_slice, GGUF blocks sliced packed), and a model that does not
split is refused naming the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgen.errors import ModelLoadError
from kvgen.loaders import load_model
from kvgen.loaders.gguf_tensors import GGUFWeight


def _assert_slices_of(full, part) -> None:
    plan = part.shard
    assert set(part.weights) == set(full.weights) and set(part.quantized) == set(full.quantized)
    for name, tensor in part.weights.items():
        assert torch.equal(tensor, plan.take(name, full.weights[name])), name
    for name, weight in part.quantized.items():
        expected = plan.take(name, full.quantized[name])
        assert isinstance(weight, GGUFWeight) and weight.shape == expected.shape, name
        assert np.array_equal(weight.raw, expected.raw), name


@pytest.mark.parametrize("fmt", ["hf", "llama2c", "gguf"])
def test_a_rank_gets_its_slices(fmt, hf_model, stories_bin, stories_dir):
    path = {"hf": lambda: hf_model("qwen2-bias-tied")[0], "llama2c": lambda: stories_bin,
            "gguf": lambda: stories_dir / "stories260K.gguf"}[fmt]()
    full, part = load_model(path), load_model(path, shard=(1, 2))
    _assert_slices_of(full, part)
    q = part.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape[0] == full.config.num_heads * full.config.head_dim // 2


def test_packed_gguf_matrices_stay_packed_in_their_slices(smollm_gguf):
    full = load_model(smollm_gguf, keep_quantized=True)
    part = load_model(smollm_gguf, keep_quantized=True, shard=(0, 2))
    _assert_slices_of(full, part)
    o = part.quantized["model.layers.0.self_attn.o_proj.weight"]
    assert o.shape == (576, 6 * 64)  # rank 0 of 2: 2 of the 3 KV heads, 6 of the 9 query heads


def test_a_model_that_does_not_split_names_the_file(stories_bin):
    with pytest.raises(ModelLoadError, match="stories260K.bin: intermediate_size 172 does not split across 3"):
        load_model(stories_bin, shard=(0, 3))
