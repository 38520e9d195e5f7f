"""The paged KV cache against the contiguous one: same tokens, same logits, prefix hits, n > 1."""

import pytest

from kvgen import LLM, SamplingParams
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.loaders import load_model
from tests.conftest import HF_MODELS
from tests.support.tolerances import assert_same_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)


def run(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    return llm.generate([prompt], params)[0]


def assert_same_run(a, b, llm: LLM):
    """Same tokens; logprobs to fp32 rounding (the runs may sum in other orders)."""
    assert a.token_ids == b.token_ids
    assert_same_logprobs(a, b, llm.engine.model_config)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_equals_contiguous(hf_model, name, block_size):
    path, _ = hf_model(name)
    contiguous = LLM(path, kv_cache="contiguous")
    paged = LLM(path, kv_cache="paged", block_size=block_size, num_kv_blocks=max(4, 4096 // block_size))
    for length in (max(block_size // 2, 1), block_size, block_size + 3):  # shorter, equal, longer than a block
        prompt = [(7 * i + 3) % 300 + 3 for i in range(min(length, 400))]
        assert_same_run(run(paged, prompt), run(contiguous, prompt), paged)


def test_prefix_hit_equals_miss(stories_bin):
    llm = LLM(stories_bin, block_size=4)
    cold = LLM(stories_bin, block_size=4, enable_prefix_caching=False)
    story = "Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog"
    first = llm.generate(story, GREEDY)[0]
    hits_before = llm.engine.kv.prefix_hits
    second = llm.generate(story, GREEDY)[0]
    assert llm.engine.kv.prefix_hits - hits_before >= len(first.prompt_token_ids) - 4
    sharing = story + " and her friend Tom"
    shared = llm.generate(sharing, GREEDY)[0]
    assert llm.engine.kv.prefix_hits > hits_before
    # Same tokens; logits to rounding (a hit prefills fewer rows, so kernels may block differently).
    assert_same_run(first, second, llm)
    assert_same_run(first, cold.generate(story, GREEDY)[0], llm)
    assert_same_run(shared, cold.generate(sharing, GREEDY)[0], llm)


def test_parallel_sampling_shares_prompt_blocks(stories_bin):
    llm = LLM(stories_bin, block_size=4)
    prompt = "Tom and Lily went to the big park to play"
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0]
    four = llm.generate(prompt, SamplingParams(n=4, temperature=0, max_tokens=30))[0]
    assert [c.token_ids for c in four.outputs] == [one.token_ids] * 4

    sampled = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=30)
    together = llm.generate(prompt, sampled)[0]
    separate = [llm.generate(prompt, sampled.for_completion(i))[0].token_ids for i in range(4)]
    assert [c.token_ids for c in together.outputs] == separate
    assert len({tuple(t) for t in separate}) > 1


def test_prompt_blocks_are_stored_once_and_copied_on_write(stories_bin):
    loaded = load_model(stories_bin)
    engine = LLMEngine(loaded, EngineConfig(block_size=4, enable_prefix_caching=False))
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks + a partial one
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=5))
    engine.step()  # prefill, fork, first tokens
    tables = [engine.kv.block_table(s.seq_id) for s in engine.requests["r"].sequences]
    assert all(t == tables[0] for t in tables)  # everything shared, nothing copied yet
    assert engine.kv.num_used_blocks == 3
    engine.step()  # each completion writes into the shared partial block: three copies, one keeps it
    tables = [engine.kv.block_table(s.seq_id) for s in engine.requests["r"].sequences]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert engine.kv.num_used_blocks == 2 + 4
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_invariants()
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["full", "window:24", "h2o:8,24"])
def test_native_decode_attention_equals_gather_and_sdpa(stories_bin, policy):
    """The in-place kernel and its CPU twin: same tokens, logprobs to rounding, over a ragged batch."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5, kv_policy=policy)
    story = "Once upon a time, there was a little girl named Lily. She loved to play in the park"
    texts = [" ".join(story.split()[:n]) for n in (1, 4, 9, 17)]
    native_llm = LLM(stories_bin, block_size=4, attention_backend="native")
    native = native_llm.generate(texts, params)
    sdpa = LLM(stories_bin, block_size=4, attention_backend="sdpa").generate(texts, params)
    for a, b in zip(native, sdpa, strict=True):
        assert_same_run(a, b, native_llm)
