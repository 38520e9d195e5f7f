"""A hybrid model (Gemma 3: windowed layers interleaved with global ones) through the engine's
features: every one gives the tokens of the plain run, and every block goes back."""

import pytest

from kvgen import LLM, SamplingParams
from kvgen.engine.snapshot import take_snapshot
from kvgen.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((40, 21, 9, 33))]


@pytest.fixture(scope="module")
def gemma(hf_model):
    return hf_model("gemma3-hybrid")[0]  # windows of 8 on three of its four layers


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    if hasattr(llm.engine, "kv"):  # the paged engine: every block back
        assert llm.engine.kv.num_used_blocks == 0
        llm.engine.kv.check_invariants()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(gemma):
    """One request at a time through the contiguous cache (every layer's K/V kept, its window masked)."""
    llm = LLM(gemma, kv_cache="contiguous")
    return [tokens(llm, [p])[0] for p in PROMPTS]


def test_batched_prefix_cached_and_chunked_runs_equal_the_contiguous_cache(gemma, reference):
    llm = LLM(gemma, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    assert tokens(llm) == reference
    assert tokens(llm) == reference  # the second time through the prefix cache
    assert llm.engine.kv.prefix_hits > 0


def test_preemption_when_a_pool_runs_dry(gemma, reference):
    llm = LLM(gemma, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    assert tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_parallel_sampling_forks_every_kind(gemma, reference):
    llm = LLM(gemma, block_size=4, num_kv_blocks=128)
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [reference[0]] * 3
    assert llm.engine.kv.num_used_blocks == 0


def test_speculation_gives_the_same_tokens(gemma, reference):
    llm = LLM(gemma, block_size=4, num_kv_blocks=128, speculative_method="ngram", num_speculative_tokens=3,
              adaptive_speculation=False)
    assert tokens(llm) == reference
    assert llm.engine.speculator.counters.verify_steps > 0


def test_a_request_window_bounds_the_global_layers_too(gemma, reference):
    """window:W on top of the model's pattern: a window longer than the text changes nothing; a short
    one gives the global layers' blocks back as the text moves on, as the windowed layers do."""
    paged = LLM(gemma, block_size=4, num_kv_blocks=128)
    long_window = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_policy="window:128")
    assert tokens(paged, params=long_window) == reference
    paged.engine.add_request("w", PROMPTS[0], SamplingParams(max_tokens=60, ignore_eos=True, kv_policy="window:12"))
    peak = 0
    while paged.engine.has_unfinished():
        paged.engine.step()
        peak = max(peak, paged.engine.kv.kinds[0].num_used_blocks)
    assert peak <= -(-(12 + 40) // 4) + 2 < -(-(40 + 60) // 4)  # bounded, not the whole text
    assert paged.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["sinks:4,16", "h2o:4,16"])
def test_sinks_and_heavy_hitters_are_refused(gemma, policy):
    llm = LLM(gemma, block_size=4, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="does not combine with this model's own sliding-window"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, kv_policy=policy))


def test_snapshot_shows_each_pool(gemma):
    llm = LLM(gemma, block_size=4, num_kv_blocks=32)
    llm.engine.add_request("r", PROMPTS[0], GREEDY)
    llm.engine.step()
    snap = take_snapshot(llm.engine)
    assert snap.pool_kinds == (("1 global layers", 32), ("3 window 8 layers", 32))
    assert len(snap.blocks.codes) == 64
    assert snap.blocks.counts()["used"] == llm.engine.kv.num_used_blocks > 0


@pytest.mark.parametrize("options", [dict(attention_backend="sdpa"), dict(fused_decode=False), dict(block_size=16),
                                     dict(quantization="int8"), dict(dtype="bfloat16"), dict(kv_cache_dtype="int8"),
                                     dict(kv_cache_dtype="bfloat16")])
def test_options_compose_with_the_hybrid_cache(gemma, reference, options):
    """Lossless options give the plain tokens; lossy ones (weights, activations or K/V in fewer bits:
    this random model's top two logits lie 0.001 apart, so its tokens may move) run to the end, give
    every block back (checked in `tokens`) and serve the next request."""
    llm = LLM(gemma, **({"block_size": 4, "num_kv_blocks": 128} | options))
    got = tokens(llm)
    if set(options) <= {"attention_backend", "fused_decode", "block_size"}:
        assert got == reference
    assert [len(g) for g in got + tokens(llm, PROMPTS[:1])] == [GREEDY.max_tokens] * (len(PROMPTS) + 1)
