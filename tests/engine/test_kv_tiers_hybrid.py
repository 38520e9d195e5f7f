"""The hybrid cache (Gemma 3: window layers beside global ones) through the KV tiers: the global kind's
blocks come back for the whole prefix, a window kind's only for the window the first computed token
reads; greedy tokens equal the plain cache's after eviction and after a restart."""

import pytest

from kvgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DOC = [(5 * i) % 250 + 3 for i in range(48)]
PROMPTS = [DOC + [11, 12, 13], [(3 * i) % 200 + 7 for i in range(56)], [(11 * i) % 230 + 5 for i in range(56)],
           DOC + [21, 22, 23, 24]]


@pytest.fixture(scope="module")
def gemma(hf_model):
    return hf_model("gemma3-hybrid")[0]  # windows of 8 on three of its four layers


def run(model, prompts, **kw):
    """Each prompt alone, in order, through a fresh engine: (tokens per prompt, prompt tokens computed, llm)."""
    llm = LLM(model, **{"block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 1, **kw})
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_used_blocks == 0
    stats = llm.engine.stats()
    return outs, stats.prefix_cache_queries - stats.prefix_cache_hits, llm


def test_a_host_tier_serves_a_hybrid_models_evicted_prefix(gemma):
    plain, computed_plain, _ = run(gemma, PROMPTS)
    tiered, computed, llm = run(gemma, PROMPTS, kv_offload_memory=16 << 20)
    assert tiered == plain
    global_kind, window_kind = llm.engine.kv.kinds
    assert global_kind.tier_hit_blocks == len(DOC) // 4  # the whole prefix of the global layers
    assert 0 < window_kind.tier_hit_blocks <= 2  # a window of 8 tokens: the last two blocks
    assert computed == computed_plain - len(DOC)


def test_a_restarted_engine_serves_a_hybrid_prefix_from_disk(gemma, tmp_path):
    plain, computed_plain, _ = run(gemma, PROMPTS[:1], num_kv_blocks=64)
    first, _, _ = run(gemma, PROMPTS[:1], num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    again, computed, llm = run(gemma, PROMPTS[-1:], num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    reference, computed_reference, _ = run(gemma, PROMPTS[-1:], num_kv_blocks=64)
    assert first == plain and again == reference
    assert computed == computed_reference - len(DOC)
    assert llm.engine.kv.tiers.counters["disk"].hits == len(DOC) // 4 + 2


def test_hybrid_tiers_with_a_small_chunk_and_a_batch(gemma):
    """Chunked prefill around restored blocks, and the prompts in one batch, as the plain cache gives."""
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 4}
    plain, _, _ = run(gemma, PROMPTS, **kw)
    tiered, _, llm = run(gemma, PROMPTS, **kw, kv_offload_memory=16 << 20)
    assert tiered == plain and llm.engine.kv.tier_hit_blocks > 0
    assert [o.token_ids for o in llm.generate(PROMPTS[::-1], GREEDY)] == plain[::-1]


@pytest.mark.slow
def test_gemma_3_270m_real_file_through_the_tiers(gemma_gguf, tmp_path):
    """The real file (window 512 on 15 of 18 layers): host tier after eviction, disk tier after a restart."""
    doc = ("The lighthouse keeper climbed the spiral stairs each evening to light the lamp, counting the "
           "steps and listening to the waves break on the rocks below the old stone tower. ") * 6
    prompts = [doc + "Who climbed the stairs?", "Write a short poem about autumn leaves. " * 8,
               "Name three rivers in Europe and one fact about each. " * 6, doc + "What did he count?"]
    kw = dict(quantization="none", dtype="float32", block_size=16, num_kv_blocks=20)
    plain, computed_plain, _ = run(gemma_gguf, prompts, **kw)
    tiered, computed, llm = run(gemma_gguf, prompts, **kw, kv_offload_memory=256 << 20)
    assert tiered == plain and computed < computed_plain
    assert llm.engine.kv.kinds[0].tier_hit_blocks > 0
    run(gemma_gguf, prompts[:1], **kw, kv_cache_dir=str(tmp_path))
    again, computed_again, llm = run(gemma_gguf, prompts[-1:], **kw, kv_cache_dir=str(tmp_path))
    assert again == plain[-1:] and llm.engine.kv.tiers.counters["disk"].hits > 0
