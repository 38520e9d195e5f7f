"""The shard plan on its own: every head, MLP column and vocabulary row is held exactly where the
Megatron layout says, shapes that cannot split are refused, and GGUF blocks split as stored."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from kvgen.config import ModelConfig
from kvgen.loaders.shard import (
    COLUMNS,
    ROWS,
    ShardingError,
    ShardPlan,
    Slice,
    Span,
    take_gguf,
)
from kvgen.loaders.gguf_tensors import GGUFWeight


def _config(heads: int, kv_heads: int, intermediate: int = 96, vocab: int = 100) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=heads * 8, intermediate_size=intermediate, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("heads,kv_heads,world", [(8, 4, 2), (8, 8, 4), (9, 3, 2), (9, 3, 3), (8, 2, 4),
                                                  (8, 1, 2), (8, 2, 8)])
def test_every_query_head_once_and_its_kv_head_beside_it(heads, kv_heads, world):
    config = _config(heads, kv_heads)
    plans = [ShardPlan(config, r, world) for r in range(world)]
    owned = [h for p in plans for h in range(p.q_heads.start, p.q_heads.stop)]
    assert owned == list(range(heads))
    group = heads // kv_heads
    for p in plans:
        assert {h // group for h in range(p.q_heads.start, p.q_heads.stop)} == set(range(p.kv_heads.start,
                                                                                         p.kv_heads.stop))
        local = p.local_config()
        assert local.num_heads % local.num_kv_heads == 0
    if world > kv_heads:  # replicated, as vLLM does
        assert all(p.kv_heads.size == 1 for p in plans)
        assert [p.kv_heads.start for p in plans] == [r // (world // kv_heads) for r in range(world)]
    vocab = [v for p in plans for v in range(p.vocab.start, p.vocab.stop)]
    assert vocab == list(range(config.vocab_size))


@pytest.mark.parametrize("heads,kv_heads,intermediate,world,problem", [
    (8, 4, 100, 3, "intermediate_size 100"),
    (8, 2, 96, 3, "cannot be replicated"),
    (6, 2, 96, 4, "cannot be replicated"),
])
def test_shapes_that_do_not_split_are_refused(heads, kv_heads, intermediate, world, problem):
    with pytest.raises(ShardingError, match=problem):
        ShardPlan(_config(heads, kv_heads, intermediate), 0, world)


@pytest.mark.parametrize("architecture, fields", [("phi3", {}), ("gemma3", {"layer_windows": (8,)})])
def test_architectures_that_do_not_split_yet_are_refused(architecture, fields):
    config = replace(_config(8, 4), architecture=architecture, **fields)
    with pytest.raises(ShardingError, match=f"does not split {architecture} models yet"):
        ShardPlan(config, 0, 2)


def test_row_parallel_bias_is_added_once():
    config = _config(4, 2)
    biases = [ShardPlan(config, r, 2).take("model.layers.0.self_attn.o_proj.bias", torch.ones(32)) for r in (0, 1)]
    assert torch.equal(biases[0] + biases[1], torch.ones(32))


def test_slices_of_a_float_matrix_are_copies_of_their_part():
    plan = ShardPlan(_config(4, 2), 1, 2)
    w = torch.arange(32 * 16, dtype=torch.float32).view(32, 16)
    q = plan.take("model.layers.0.self_attn.q_proj.weight", w)
    assert torch.equal(q, w[16:32]) and q.untyped_storage().nbytes() == q.numel() * 4
    o = plan.take("model.layers.0.self_attn.o_proj.weight", w.T.contiguous())
    assert torch.equal(o, w.T[:, 16:32])


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_gguf_blocks_split_by_rows_and_at_block_columns(kind):
    values = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, kind)
    weight = GGUFWeight("w", kind, (8, 128), raw)
    full = weight.dequantize()
    rows = take_gguf(weight, Slice(ROWS, Span(2, 6)))
    assert rows.shape == (4, 128) and torch.equal(rows.dequantize(), full[2:6])
    columns = take_gguf(weight, Slice(COLUMNS, Span(32, 96)))
    assert columns.shape == (8, 64) and torch.equal(columns.dequantize(), full[:, 32:96])
    with pytest.raises(ShardingError, match="block"):
        take_gguf(weight, Slice(COLUMNS, Span(16, 80)))
