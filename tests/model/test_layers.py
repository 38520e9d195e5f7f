"""RoPE tables against transformers' own: YaRN (gpt-oss) with its correction range truncated and not."""

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvgen.config import ModelConfig
from kvgen.model.layers import RotaryEmbedding, rope_attention_factor, rope_inv_freq


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim,theta", [(16, 150000.0), (64, 150000.0), (64, 10000.0)])
def test_yarn_matches_transformers(truncate, head_dim, theta):
    """Frequencies bit for bit and the cos/sin scale (0.1 ln 32 + 1) as transformers computes them."""
    hf = GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=head_dim, num_attention_heads=4,
                      num_key_value_heads=2, rope_parameters={
                          "rope_type": "yarn", "rope_theta": theta, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": truncate, "original_max_position_embeddings": 4096})
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = ModelConfig.from_hf(hf.to_dict())
    assert torch.equal(rope_inv_freq(config), want)
    assert rope_attention_factor(config) == scale != 1.0
    table = RotaryEmbedding(config, 8, torch.device("cpu"), torch.float32)
    freqs = torch.arange(8.0)[:, None] * want
    assert torch.equal(table.cos[:, : head_dim // 2], freqs.cos() * scale)


def test_yarn_with_mscales_takes_their_ratio():
    """DeepSeek's form of the attention factor: mscale over mscale_all_dim, as transformers computes it."""
    hf = GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})
    _, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert rope_attention_factor(ModelConfig.from_hf(hf.to_dict())) == scale != 1.0


def test_the_other_scalings_leave_cos_and_sin_unscaled():
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=8, max_position_embeddings=8, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert rope_attention_factor(config) == 1.0
