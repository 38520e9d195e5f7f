"""Speculation by the checkpoint's MTP layer (kvgen.engine.speculative.mtp) on the Qwen3.5 and Qwen3.5-MoE
fixtures with one MTP layer (tests/loaders/arch_fixtures.mtp_checkpoint), fp32: greedy output equals plain decoding
alone, in a ragged batch with chunked prefill, with n = 2, under preemption and after a prefix-cache
hit; and the head's state at each step is the one transformers' modules give over the tokens so far,
chained guesses and rejected tokens notwithstanding. Random weights guess the target's tokens almost
never, so acceptance is not what these tests measure; the head's numbers are."""

import pytest
import torch

from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.loaders import load_model
from kvgen.sampling_params import SamplingParams
from tests.engine.test_continuous_batching import finished_outputs, run_all
from tests.loaders.arch_fixtures import mtp_checkpoint
from tests.model.test_mtp import reference_head_logits
from tests.support.tolerances import fp32_gap, model_reduction_length

PROMPTS = [[(7 * i + 3) % 500 + 10 for i in range(n)] for n in (10, 200, 41)]


@pytest.fixture(scope="module", params=[("qwen35", "hf"), ("qwen35", "gguf"), ("qwen35moe", "gguf")], ids="-".join)
def loaded(request):
    arch, source = request.param
    checkpoint = mtp_checkpoint(arch)
    return load_model(str(checkpoint.hf_dir if source == "hf" else checkpoint.gguf))


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(quantization="none", **options))


def mtp(k: int, **options) -> dict:
    """MTP speculation that always proposes K (no adaptive switch, no confidence cut)."""
    return dict(speculative_method="mtp", num_speculative_tokens=k, draft_p_min=0.0,
                **{"adaptive_speculation": False, **options})


def greedy(max_tokens: int = 32, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def assert_clean(eng: LLMEngine) -> None:
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0
    assert not eng.speculator.proposer.last and not eng.speculator.proposer.pending


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_alone_equals_plain(loaded, k):
    requests = [(p, greedy()) for p in PROMPTS]
    want = [run_all(engine(loaded), [r])[0] for r in requests]
    for request, expected in zip(requests, want):
        eng = engine(loaded, **mtp(k))
        assert run_all(eng, [request])[0] == expected
        assert eng.speculator.counters.proposed >= 20 * k  # a guess at nearly every step
        assert_clean(eng)


def test_ragged_batch_with_chunked_prefill_and_n_2_equals_plain(loaded):
    requests = [(PROMPTS[i % 3][: 10 + 37 * i], greedy(8 + 5 * i, n=1 + i % 2)) for i in range(6)]
    want = finished_outputs(engine(loaded, max_num_batched_tokens=24), requests)
    eng = engine(loaded, max_num_batched_tokens=24, **mtp(3))
    got = finished_outputs(eng, requests)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert eng.speculator.counters.proposed > 0
    assert_clean(eng)


def test_greedy_under_preemption_equals_plain_and_leaks_nothing(loaded):
    requests = [(PROMPTS[i % 3][: 10 + 9 * i], greedy(40)) for i in range(8)]
    want = run_all(engine(loaded), requests)
    tight = engine(loaded, num_kv_blocks=20, block_size=8, **mtp(3))
    assert run_all(tight, requests) == want
    assert tight.scheduler.num_preemptions > 0
    assert_clean(tight)


def head_gap(eng: LLMEngine) -> tuple[float, float]:
    """(largest difference, bound) between the head's logits from its state at the live sequence's
    last verified position and transformers' modules over that sequence's tokens."""
    proposer = eng.speculator.proposer
    (seq,) = eng.scheduler.running
    proposer.catch_up([seq])  # as the next proposal would
    position, state = proposer.last[seq.seq_id]
    assert position == seq.num_tokens - 2  # the state that guesses the next verify step's first token
    got = proposer.head.logits(state[None])[0]
    want = reference_head_logits(seq.token_ids, eng.model_config.architecture)[position]
    assert torch.equal(got.argmax(), want.argmax())
    config = proposer.head.config
    bound = fp32_gap(model_reduction_length(config, seq.num_tokens) + 2 * config.hidden_size, want.abs().max().item())
    return (got - want).abs().max().item(), bound


@pytest.mark.parametrize("prefix_hit", [False, True])
def test_the_heads_state_is_transformers_after_chained_guesses_and_rejections(loaded, prefix_hit):
    """After several verify steps with K = 3 (each writing the head's K/V at guessed positions, which
    the next step rewrites from the target's states), and on a prompt whose first blocks come from the
    prefix cache (their head K/V written for the sequence that computed them)."""
    eng = engine(loaded, **mtp(3))
    if prefix_hit:
        run_all(eng, [(PROMPTS[1], greedy(4))])
    eng.add_request("r", PROMPTS[1] + [77, 78], greedy(40))
    for _ in range(12):
        eng.step()
    if prefix_hit:
        assert eng.kv.prefix_hits > 0
    assert eng.speculator.counters.verify_steps >= 10
    gap, bound = head_gap(eng)
    assert gap <= bound


def test_states_kept_through_plain_steps_run_when_speculation_comes_back(loaded):
    """While the adaptive switch decodes plainly the head does not run; the states wait, and the first
    speculative step runs them all (a 300-token prompt's in a pass of its own: FLUSH_ROWS)."""
    eng = engine(loaded, **mtp(3, adaptive_speculation=True))
    steps = []
    eng.speculator.switch.decide = lambda batch_size: len(steps) >= 8  # plain for 8 steps, then speculate
    prompt = [(5 * i + 1) % 480 + 10 for i in range(300)]
    eng.add_request("r", prompt, greedy(40))
    for _ in range(8):
        steps.append(eng.step())
    proposer = eng.speculator.proposer
    assert eng.speculator.counters.verify_steps == 0 and len(proposer.pending[eng.scheduler.running[0].seq_id][1]) == 7
    for _ in range(4):
        steps.append(eng.step())
    assert eng.speculator.counters.verify_steps >= 3
    gap, bound = head_gap(eng)
    assert gap <= bound
    while eng.has_unfinished():
        eng.step()
    assert_clean(eng)


def test_a_model_without_mtp_layers_is_refused_in_one_line():
    from tests.loaders.arch_fixtures import arch_checkpoint

    with pytest.raises(ValueError, match="carries MTP layers; this one has none"):
        engine(load_model(str(arch_checkpoint("qwen35").gguf)), **mtp(2))
