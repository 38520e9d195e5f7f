"""Many requests at once: batch invariance, chunked prefill, preemption, aborts, timings."""

import asyncio
import random

import pytest

from kvgen import LLM, SamplingParams
from kvgen.async_llm import AsyncLLM
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.errors import InvalidRequestError
from kvgen.loaders import load_model
from kvgen.scheduling.sequence import RequestOutput
from tests.support.tolerances import assert_same_logprobs

WORDS = "the a cat dog Lily Tom park ball happy sad big little ran jumped saw played with and sun tree".split()


def prompts(count: int, seed: int = 0, longest: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest))) for _ in range(count)]


@pytest.fixture(scope="module")
def loaded(stories_bin):
    return load_model(stories_bin)


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**options))


def finished_outputs(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list[RequestOutput]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(requests))]


def run_all(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list[list[int]]:
    return [o.token_ids for o in finished_outputs(engine, requests)]


def alone(loaded, requests):
    return [run_all(engine(loaded), [r])[0] for r in requests]


def test_batch_of_32_equals_each_alone_greedy_and_seeded(loaded):
    texts = prompts(32)
    greedy = [(t, SamplingParams(temperature=0, max_tokens=40)) for t in texts]
    seeded = [(t, SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=40)) for i, t in enumerate(texts)]
    for requests in (greedy, seeded):
        batched = engine(loaded, max_num_batched_tokens=64)  # the long prompts are chunked
        assert run_all(batched, requests) == alone(loaded, requests)
        assert batched.stats().kv_blocks_used == 0


def test_batching_changes_logprobs_by_rounding_only(loaded):
    """Batched rows run through a GEMM (and attention over padded keys), a lone decode through a GEMV:
    the low bits differ, nothing more. Top-5 candidates agree, their logprobs to fp32 rounding."""
    requests = [(t, SamplingParams(temperature=0, max_tokens=24, logprobs=5)) for t in prompts(24, seed=3)]
    batched = finished_outputs(engine(loaded, max_num_batched_tokens=64), requests)
    each_alone = [finished_outputs(engine(loaded), [r])[0] for r in requests]
    for got, want in zip(batched, each_alone, strict=True):
        assert got.token_ids == want.token_ids
        assert_same_logprobs(got, want, loaded.config)


def test_small_pool_preempts_and_results_are_unchanged(loaded):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    requests = [(t, params) for t in prompts(12, seed=1, longest=40)]
    tight = engine(loaded, num_kv_blocks=24, block_size=8)  # 192 slots for up to ~12 x 100 tokens
    assert run_all(tight, requests) == alone(loaded, requests)
    assert tight.scheduler.num_preemptions > 0
    tight.kv.check_invariants()
    assert tight.kv.num_used_blocks == 0


def test_impossible_request_is_refused_and_others_finish(loaded):
    small = engine(loaded, num_kv_blocks=8, block_size=8)  # 64 tokens of KV
    with pytest.raises(InvalidRequestError, match="KV cache capacity of 64 tokens"):
        small.add_request("big", "Once upon a time", SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="context of 512 tokens"):
        small.add_request("long", "Once upon a time", SamplingParams(max_tokens=600))
    assert len(run_all(small, [("Tom ran", SamplingParams(temperature=0, max_tokens=20))])[0]) > 0


def test_abort_mid_flight_frees_every_block(loaded):
    eng = engine(loaded, block_size=4)
    for i, text in enumerate(prompts(6, seed=2)):
        eng.add_request(str(i), text, SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert eng.kv.num_used_blocks > 0
    for i in range(6):
        eng.abort(str(i))
    assert not eng.has_unfinished()
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0


def test_async_cancel_aborts_and_frees_blocks(loaded):
    llm = AsyncLLM(engine(loaded))

    async def scenario():
        finished = asyncio.create_task(_collect(llm, "Tom had a dog", 30))
        stream = llm.generate("Lily liked the sun", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) >= 5:
                break
        await stream.aclose()
        text = await finished
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await llm.shutdown()
        return text

    text = asyncio.run(scenario())
    assert text
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_used_blocks == 0


def test_async_generate_counts_at_once_and_a_stream_never_read_is_aborted(loaded):
    """Admission control reads num_waiting right after generate returns (before any task iterates the
    stream): the request must count already, and closing a stream nobody read must free its blocks."""
    llm = AsyncLLM(engine(loaded))

    async def scenario() -> int:
        streams = [llm.generate("Lily liked the sun", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                   for _ in range(3)]
        counted = llm.num_waiting()
        await asyncio.sleep(0.05)  # the loop adds them and starts stepping
        for stream in streams:
            await stream.aclose()
        for _ in range(200):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await llm.shutdown()
        return counted

    assert asyncio.run(scenario()) == 3
    assert not llm.engine.has_unfinished()
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_used_blocks == 0


async def _collect(llm: AsyncLLM, prompt: str, max_tokens: int) -> str:
    text = ""
    async for out in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        text += out.outputs[0].new_text
    assert text == out.text
    return text


def test_chunked_prefill_interleaves_with_decodes(loaded):
    eng = engine(loaded, max_num_batched_tokens=32)
    eng.add_request("running", "Tom", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    eng.step()
    long_prompt = list(range(3, 203))  # 200 tokens: at least 7 chunks of <= 31 tokens
    eng.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=5))
    running = eng.requests["running"].sequences[0]
    prefilling = eng.requests["long"].sequences[0]
    steps = 0
    while prefilling.num_computed_tokens < len(long_prompt):
        before = len(running.output_token_ids)
        eng.step()
        steps += 1
        assert len(running.output_token_ids) == before + 1
    assert steps >= 7


def test_llm_generate_reports_timings(stories_bin):
    out = LLM(stories_bin).generate(["Once upon a time"] * 3, SamplingParams(temperature=0, max_tokens=20,
                                                                             ignore_eos=True), use_tqdm=True)
    for o in out:
        m = o.metrics
        assert 0 < m.ttft <= m.e2e_latency
        assert m.mean_time_per_output_token > 0
        assert len(m.token_times) == 20
