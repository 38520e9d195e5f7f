"""SmolLM2-135M (real weights, 9 query heads over 3 KV heads) on two ranks against one, batch of
one (the whole path matrix is test_parity.py's, marked slow for this model). A module of its own: a
process runs one tensor-parallel engine at a time, and test_parity.py's last one lives to its end."""

from __future__ import annotations

import pytest

from kvgen import LLM
from tests.distributed.test_parity import _assert_same, _greedy

SMOLLM_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm_tp2(smollm_gguf):
    """KV heads split 2 + 1 (whole GQA groups: 6 and 3 query heads), as smollm_llm but on two ranks."""
    llm = LLM(smollm_gguf, quantization="none", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              tensor_parallel_size=2)
    yield llm
    llm.close()


def test_smollm2_tp2_batch_of_one(smollm_llm, smollm_tp2):
    _assert_same(smollm_llm, smollm_tp2, [SMOLLM_PROMPT], _greedy(max_tokens=8))
    plans = smollm_tp2.engine.shard_plans
    assert [(p.kv_heads.size, p.q_heads.size) for p in plans] == [(2, 6), (1, 3)]
