"""`take_snapshot`: the engine between steps, as the dashboard and `--show-kv` see it, on stories260K."""

import pytest

from kvgen import SamplingParams
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.snapshot import take_snapshot
from kvgen.loaders import load_model
from kvgen.server.metrics import ServerMetrics

PROMPT = "Once upon a time there was a little girl named Lily. She liked to play in the park"


@pytest.fixture(scope="module")
def loaded(stories_bin):
    return load_model(stories_bin)


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**options))


def params(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def test_steps_record_prefill_and_decode_tokens_and_batch_size(loaded):
    eng = engine(loaded, block_size=4, max_num_batched_tokens=16)
    prompt_len = len(eng.encode_prompt(PROMPT))
    eng.add_request("a", PROMPT, params(5))
    eng.add_request("b", PROMPT, params(5, n=3))
    while eng.has_unfinished():
        eng.step()
    records = list(eng.step_log.records)
    assert [r.number for r in records] == list(range(1, eng.step_log.num_steps + 1))
    prefill = sum(r.prefill_tokens for r in records)
    # b's prompt is a prefix hit on a's blocks only where a's were already full when b was scheduled,
    # so prefill lies between one prompt and two; every generated token but each first is a decode.
    assert prompt_len < prefill <= 2 * prompt_len
    assert sum(r.decode_tokens for r in records) == 4 * (5 - 1)
    assert max(r.batch_size for r in records) == 4 and all(r.prefill_tokens <= 16 for r in records)
    assert all(r.ms > 0 and r.preempted == 0 for r in records)


def test_a_snapshot_agrees_with_stats_and_metrics_between_steps(loaded):
    eng = engine(loaded, block_size=4, num_kv_blocks=200)
    metrics = ServerMetrics(eng)
    eng.add_request("a", PROMPT, params(40))
    eng.add_request("b", PROMPT, params(40, n=3))
    seen_shared = False
    while eng.has_unfinished():
        eng.step()
        snap = take_snapshot(eng)
        counts = snap.blocks.counts()
        values = metrics.values(snap.stats)
        assert sum(counts.values()) == snap.num_blocks == 200
        assert counts["used"] + counts["shared"] == eng.kv.num_used_blocks == values["kvgen_kv_cache_blocks_used"]
        assert counts["cached"] == eng.kv.num_cached_free_blocks
        assert values["kvgen_num_requests_running"] == len([s for s in snap.sequences if s.status == "running"])
        assert sum(s.num_blocks for s in snap.sequences) == snap.blocks.ref_count.sum()
        seen_shared |= counts["shared"] > 0
        assert snap.step == eng.step_log.num_steps and snap.steps[-1].number == snap.step
    assert seen_shared  # n = 3 shares the prompt blocks copy-on-write
    final = take_snapshot(eng).blocks.counts()
    assert final["used"] == final["shared"] == 0 and final["cached"] > 0


def test_sequences_show_phase_blocks_policy_and_preemptions(loaded):
    eng = engine(loaded, block_size=4, num_kv_blocks=24, max_num_batched_tokens=8)
    eng.add_request("long", PROMPT, params(30, kv_policy="window:16"))
    eng.step()
    (info,) = take_snapshot(eng).sequences
    assert (info.request_id, info.status, info.phase, info.kv_policy) == ("long", "running", "prefill", "window:16")
    assert info.computed_tokens == 8 and info.num_blocks == 2  # a chunk of 8 tokens computed: two blocks
    while take_snapshot(eng).sequences[0].phase == "prefill":
        eng.step()
    info = take_snapshot(eng).sequences[0]
    assert info.output_tokens >= 1 and info.computed_tokens == info.prompt_tokens + info.output_tokens - 1
    tight = engine(loaded, num_kv_blocks=12, block_size=8)
    for i in range(6):
        tight.add_request(str(i), PROMPT, params(40))
    most = 0
    while tight.has_unfinished():
        tight.step()
        most = max([most] + [s.preemptions for s in take_snapshot(tight).sequences])
    assert tight.scheduler.num_preemptions > 0 and most > 0
    assert sum(r.preempted for r in tight.step_log.records) == tight.scheduler.num_preemptions


def test_blocks_a_window_releases_show_as_released_until_reused(loaded):
    eng = engine(loaded, block_size=4, num_kv_blocks=64)
    eng.add_request("w", PROMPT, params(60, kv_policy="window:8"))
    shown = 0
    while eng.has_unfinished():
        eng.step()
        record = eng.step_log.records[-1]
        snap = take_snapshot(eng)
        released = [i for i, code in enumerate(snap.blocks.codes.tolist()) if code == 4]
        assert released == sorted(b for b in record.released if eng.kv.pool.blocks[b].ref_count == 0)
        shown += len(released)
    assert shown > 5
    assert take_snapshot(eng, released_since=0).blocks.counts()["released"] > 0  # all of them, since the start
