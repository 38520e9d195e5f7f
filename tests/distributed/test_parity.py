"""Tensor parallelism against one process: greedy fp32 on the CPU over gloo gives the same tokens,
and log-probabilities within the fp32 bound of a changed summation order (tests/support/tolerances.py: the
row-parallel all-reduce splits each o_proj / down_proj dot product into per-rank partial sums, the
same kind of reordering a different BLAS blocking makes). Where packed layers run a prompt's rows on
oneDNN, whose outputs come back rounded to bf16, the tokens agree up to near-ties within bf16's
rounding instead.

Each model runs one TP=1 and one TP>1 engine for the whole module (spawning workers is slow) over
the engine's paths: batch 1, a ragged batch of 32, a prefix-cache hit, n = 2 (forks and
copy-on-write), bounded policies (a sliding window, attention sinks whose keys are re-rotated).
"""

from __future__ import annotations

import random

import pytest

from kvgen import LLM, SamplingParams
from kvgen.distributed.group import DistributedError
from kvgen.errors import InvalidRequestError
from tests.conftest import SMALL, _word_tokenizer, build_hf_model
from tests.support.tolerances import KV_ROUNDING, agreeing_prefix, assert_same_logprobs, trace

ENGINE = {"num_kv_blocks": 384, "max_num_seqs": 32, "block_size": 8}
MAX_TOKENS = 12


def _mistral_window(root):
    """A Mistral-style model with a sliding window of 16, shorter than the ragged prompts."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(7)
    model = MistralForCausalLM(MistralConfig(**(SMALL | {"sliding_window": 16, "num_attention_heads": 4,
                                                         "num_key_value_heads": 2})))
    path = root / "mistral-window"
    model.save_pretrained(path)
    _word_tokenizer(SMALL["vocab_size"], path)
    return path


# name -> (how to get the model, tensor_parallel_size, extra engine options)
MODELS = {
    "stories260K": (lambda root, stories_bin, gguf: stories_bin, 2, {}),
    # int8 pools with their per-(token, head) scales, and too few blocks for 32 sequences: preemption
    "stories260K-int8-kv-preempting": (lambda root, stories_bin, gguf: stories_bin, 2,
                                       {"kv_cache_dtype": "int8", "num_kv_blocks": 48}),
    "llama-8kv": (lambda root, *_: build_hf_model("llama-gqa", root, num_attention_heads=8,
                                                   num_key_value_heads=8)[0], 2, {}),
    "qwen2-bias": (lambda root, *_: build_hf_model("qwen2-bias-tied", root)[0], 2, {}),
    "qwen3-qk-norm": (lambda root, *_: build_hf_model("qwen3-qk-norm", root)[0], 2, {}),
    "llama-1kv-replicated": (lambda root, *_: build_hf_model("llama3-rope-scaling", root)[0], 2, {}),
    "mistral-window": (lambda root, *_: _mistral_window(root), 2, {}),
    "smollm2-tp2": (lambda root, stories_bin, gguf: gguf(), 2, {"quantization": "none"}),
    "smollm2-tp3": (lambda root, stories_bin, gguf: gguf(), 3, {"quantization": "none"}),
    "smollm2-packed-tp2": (lambda root, stories_bin, gguf: gguf(), 2, {}),
}
# SmolLM2 over every path takes minutes on two cores: the default suite runs its batch of one
# (test_parity_smollm.py), the whole matrix is slow.
SLOW = {"smollm2-tp2", "smollm2-tp3", "smollm2-packed-tp2"}


@pytest.fixture(scope="module", params=[pytest.param(m, marks=[pytest.mark.slow] if m in SLOW else [])
                                        for m in MODELS])
def pair(request, tmp_path_factory, stories_bin):
    """(TP=1 engine, TP=N engine) on one model."""
    find, size, options = MODELS[request.param]
    path = find(tmp_path_factory.mktemp(request.param), stories_bin, lambda: request.getfixturevalue("smollm_gguf"))
    one = LLM(path, **(ENGINE | options))
    many = LLM(path, **(ENGINE | options), tensor_parallel_size=size)
    yield one, many
    many.close()


def _greedy(**overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 2, "ignore_eos": True}
                             | overrides))


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def _rounds_to_bf16(llm: LLM) -> bool:
    """Whether some layers run a prompt's rows on oneDNN's GEMM, which returns them rounded to bf16
    (kvgen.model.linear_choice): under TP each rank's partial sum is rounded before the all-reduce,
    a bf16 step where one rank rounds the whole sum once."""
    return any("onednn" in kernel for kernel, _ in llm.engine.runner.model.kernels().values())


def _assert_same(one: LLM, many: LLM, prompts, params) -> None:
    expected, got = one.generate(prompts, params), many.generate(prompts, params)
    rounded = _rounds_to_bf16(one)
    for a, b in zip(expected, got, strict=True):
        assert b.error is None
        if rounded:  # the same tokens up to near-ties within bf16's rounding, logprobs within it
            for want, run in zip(a.outputs, b.outputs, strict=True):
                agreeing_prefix(trace(run), trace(want), KV_ROUNDING["bfloat16"])
            continue
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        if one.engine.config.kv_cache_dtype == "auto":
            # (Quantized pools round each K/V to a step of 1/127 of its row's largest value, so an
            # fp32-rounding difference before the write can become a whole step: tokens only.)
            assert_same_logprobs(a, b, one.engine.model_config)


def test_batch_of_one(pair):
    one, many = pair
    _assert_same(one, many, _prompts(one.engine.model_config.vocab_size, 1, seed=1), _greedy())


def test_ragged_batch_of_32(pair):
    one, many = pair
    preempted = many.engine.stats().num_preemptions
    _assert_same(one, many, _prompts(one.engine.model_config.vocab_size, 32, seed=2), _greedy())
    if many.engine.kv.num_blocks < 64:  # the preempting engine must have preempted
        assert many.engine.stats().num_preemptions > preempted


def test_prefix_hit(pair):
    one, many = pair
    prompt = _prompts(one.engine.model_config.vocab_size, 1, seed=3)[0] * 3
    _assert_same(one, many, [prompt], _greedy())
    hits = many.engine.stats().prefix_cache_hits
    _assert_same(one, many, [prompt], _greedy())
    assert many.engine.stats().prefix_cache_hits > hits


def test_n2_forks_share_blocks(pair):
    one, many = pair
    _assert_same(one, many, _prompts(one.engine.model_config.vocab_size, 3, seed=4), _greedy(n=2))


def test_attention_sinks_rerotate_keys(pair):
    """sinks:4,12 re-rotates cached keys once the window slides: the rotation tables go to the workers."""
    one, many = pair
    if one.engine.model_config.sliding_window is not None:
        pytest.skip("the model's own window replaces the policy")
    _assert_same(one, many, _prompts(one.engine.model_config.vocab_size, 2, seed=5),
                 _greedy(kv_policy="sinks:4,12", max_tokens=24))



def test_h2o_is_refused(pair):
    _, many = pair
    with pytest.raises(InvalidRequestError, match="h2o is not supported with tensor parallelism"):
        many.generate([[5, 6, 7]], _greedy(kv_policy="h2o:4,8"))


def test_one_tensor_parallel_engine_per_process(pair):
    with pytest.raises(DistributedError, match="already runs a tensor-parallel engine"):
        LLM(tensor_parallel_size=2)
