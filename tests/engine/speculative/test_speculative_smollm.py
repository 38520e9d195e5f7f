"""Speculative decoding on the real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32): greedy
output equals plain decoding token for token, for prompt lookup and the int4 self-draft."""

import pytest

from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.sampling_params import SamplingParams
from tests.engine.test_continuous_batching import prompts, run_all

PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
           "Every night for forty years, Martha climbed the hundred and twelve steps to light the lamp.")
PROMPTS = [f"Repeat the following passage exactly.\n\n{PASSAGE}\n\n", "The capital of France is",
           f"Rewrite this in the past tense: {PASSAGE}", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm(smollm_gguf):
    from kvgen.llm import load

    return load(smollm_gguf, EngineConfig(quantization="none"))


def spec_engine(smollm, smollm_gguf, method: str, k: int, **options) -> LLMEngine:
    config = EngineConfig(quantization="none", num_kv_blocks=options.pop("num_kv_blocks", 256), max_num_seqs=32,
                          speculative_method=method, num_speculative_tokens=k, adaptive_speculation=False,
                          draft_model=str(smollm_gguf) if method == "draft" else None,
                          draft_quantization="int4", **options)
    return LLMEngine(smollm, config, smollm if method == "draft" else None)


def plain(smollm_llm, requests) -> list[list[int]]:
    return [o.token_ids for o in smollm_llm.generate([p for p, _ in requests], [s for _, s in requests])]


def check(smollm, smollm_gguf, smollm_llm, method, k, requests, **options) -> LLMEngine:
    eng = spec_engine(smollm, smollm_gguf, method, k, **options)
    assert run_all(eng, requests) == plain(smollm_llm, requests)
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0
    return eng


BATCH = [(p, SamplingParams(temperature=0, max_tokens=20)) for p in PROMPTS]


@pytest.fixture(scope="module")
def batch_plain(smollm_llm) -> list[list[int]]:
    return plain(smollm_llm, BATCH)


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_greedy_batch_equals_plain(smollm, smollm_gguf, batch_plain, method):
    eng = spec_engine(smollm, smollm_gguf, method, 3)
    assert run_all(eng, BATCH) == batch_plain
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0
    if method == "ngram":  # the repeated passage is found in the prompt
        assert eng.speculator.counters.acceptance_rate > 0.3


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_alone_equals_plain_k(smollm, smollm_gguf, smollm_llm, method, k):
    for p in PROMPTS[:2]:
        check(smollm, smollm_gguf, smollm_llm, method, k, [(p, SamplingParams(temperature=0, max_tokens=32))])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_ragged_batch_of_32_and_preemption_equal_plain(smollm, smollm_gguf, smollm_llm, method):
    texts = (PROMPTS * 8)[:16] + prompts(16, seed=5, longest=40)
    requests = [(t, SamplingParams(temperature=0, max_tokens=8 + 3 * i % 29)) for i, t in enumerate(texts)]
    check(smollm, smollm_gguf, smollm_llm, method, 4, requests)
    tight = check(smollm, smollm_gguf, smollm_llm, method, 4, requests[:12], num_kv_blocks=24, block_size=8)
    assert tight.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def smollm_packed(smollm_gguf):
    """The file as served by default: its Q4_1 / Q8_0 matrices kept packed, on the integer kernels."""
    from kvgen.llm import load

    return load(smollm_gguf, EngineConfig(quantization="auto"))


def test_greedy_on_the_packed_file_equals_plain(smollm_packed):
    """A verify chunk of K + 1 rows runs the packed kernels (and the fused step) at more rows than a
    decode; each row's result must not depend on the rows beside it, so the tokens stay plain's."""
    requests = [(p, SamplingParams(temperature=0, max_tokens=24)) for p in PROMPTS[:3]]
    options = dict(quantization="auto", num_kv_blocks=256, max_num_seqs=8)
    plain_tokens = run_all(LLMEngine(smollm_packed, EngineConfig(**options)), requests)
    for k in (2, 6):  # 3 and 7 rows: both sides of the kernel's 4-row passes (6 and 14 rows of x's parts)
        eng = LLMEngine(smollm_packed, EngineConfig(**options, speculative_method="ngram", num_speculative_tokens=k,
                                                    adaptive_speculation=False))
        assert run_all(eng, requests) == plain_tokens
        eng.kv.check_invariants()
        assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0
