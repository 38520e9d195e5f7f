"""The int8 / fp8 KV cache through the whole engine: every path that reads the pools agrees, and it
composes with prefix caching, copy-on-write, preemption and the bounded policies."""

import pytest

from kvgen import LLM, SamplingParams
from kvgen.config import EngineConfig
from tests.support.tolerances import assert_same_logprobs

STORY = "Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog"
TEXTS = [" ".join(STORY.split()[:n]) for n in (1, 4, 9, 17)]
QUANTIZED = ["int8", "fp8"]
# One step of the pool's format, relative: int8 keeps 7 bits below its scale, e4m3 3 mantissa bits.
KV_STEP = {"int8": 2.0**-7, "fp8": 2.0**-3}


def greedy(max_tokens: int = 40, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **extra)


def same(got, want, llm: LLM, relative_floor: float = 0.0) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert_same_logprobs(g, w, llm.engine.model_config, relative_floor)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("policy", ["full", "window:24", "h2o:8,24"])
def test_kernel_and_gather_agree_on_quantized_pools(kv_dtype, policy):
    """The two attention paths differ by fp32 rounding. Where a K/V value that the next layer writes
    lies that close to a rounding midpoint of the pool's format, its quantized code flips by one
    step, and later logprobs move by the pool's step (KV_STEP, of max(|logprob|, 1)) rather than
    by fp32's rounding. (tests/model/test_kernels.py compares the two on the same pool contents, to
    fp32 rounding.)"""
    native = LLM(block_size=4, kv_cache_dtype=kv_dtype, attention_backend="native")
    sdpa = LLM(block_size=4, kv_cache_dtype=kv_dtype, attention_backend="sdpa")
    params = greedy(kv_policy=policy)
    same(native.generate(TEXTS, params), sdpa.generate(TEXTS, params), native, KV_STEP[kv_dtype])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_hit_equals_miss_on_quantized_values(kv_dtype):
    warm = LLM(block_size=4, kv_cache_dtype=kv_dtype)
    cold = LLM(block_size=4, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    first = warm.generate(STORY, greedy())
    hits = warm.engine.kv.prefix_hits
    second = warm.generate(STORY, greedy())
    assert warm.engine.kv.prefix_hits - hits >= len(first[0].prompt_token_ids) - 4
    same(second, first, warm)
    same(cold.generate(STORY, greedy()), first, warm)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_copy_on_write_and_preemption_change_nothing(kv_dtype):
    llm = LLM(block_size=4, kv_cache_dtype=kv_dtype)
    one = llm.generate(TEXTS[2], greedy(30))[0]
    (three,) = llm.generate(TEXTS[2], SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True))
    assert [c.token_ids for c in three.outputs] == [one.token_ids] * 3
    alone = [llm.generate(t, greedy(60))[0].token_ids for t in TEXTS]
    tight = LLM(block_size=4, num_kv_blocks=40, kv_cache_dtype=kv_dtype)  # 160 slots for 4 x ~75 tokens
    batched = tight.generate(TEXTS, greedy(60))
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in batched] == alone
    assert tight.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_sinks_run_past_the_context_on_quantized_pools(kv_dtype):
    """Attention sinks re-rotate keys after dequantizing them; while the text fits in S + W they see
    what the full cache sees."""
    llm = LLM(block_size=4, kv_cache_dtype=kv_dtype)
    fits = llm.generate(TEXTS[1], greedy(100, kv_policy="sinks:4,200"))
    same(fits, llm.generate(TEXTS[1], greedy(100)), llm)
    (long,) = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=700, ignore_eos=True,
                                                    kv_policy="sinks:4,60"))
    assert len(long.token_ids) == 700 > llm.engine.max_model_len


def test_the_same_budget_holds_more_tokens():
    """stories260K: 5 layers x 4 KV heads x head_dim 8, K and V: 1280 bytes a token in fp32, 640 in
    bf16, and 2 x 5 x 4 x (8 + a 4-byte scale) = 480 in int8 or fp8."""
    budget, block = 1 << 20, 16
    for kv_dtype, per_token in (("auto", 1280), ("bfloat16", 640), ("int8", 480), ("fp8", 480)):
        engine = LLM(kv_cache_memory=budget, kv_cache_dtype=kv_dtype).engine
        assert engine.bytes_per_token == per_token
        assert engine.capacity_tokens == budget // (block * per_token) * block
    assert "480 bytes/token, int8" in LLM(kv_cache_dtype="int8").engine.capacity_report()


def test_quantized_pools_need_the_paged_cache():
    with pytest.raises(ValueError, match="needs the paged KV cache"):
        EngineConfig(kv_cache="contiguous", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
