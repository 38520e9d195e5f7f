"""Speculative decoding in the paged engine (stories260K, fp32): greedy output equals plain decoding
token for token, for both proposers and K in {1, 3, 8}, alone, in a ragged batch of 32 and under
preemption; no block leaks; sampled output keeps the target's distribution; bad input is refused."""

import random
import re

import pytest
import torch
from scipy.stats import chi2_contingency

from kvgen import LLM
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.speculative.adaptive import (GUESS_STREAK, MAX_PROBE_EVERY, MIN_SAMPLES, PROBE_EVERY,
                                              AdaptiveSwitch)
from kvgen.engine.speculative.speculator import MAX_EXACT_TOKENS
from kvgen.errors import InvalidRequestError, ModelLoadError
from kvgen.loaders import load_model
from kvgen.model.attention import IN_PLACE_QUERIES
from kvgen.model.fused import FUSED_BELOW_ROWS
from kvgen.model.linear import DECODED_FROM_ROWS
from kvgen.model.quant_linear import BF16_FROM_ROWS, FP32_FROM_ROWS, MANY_ROWS
from kvgen.model.kernels.paged_decode import paged_decode_for
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.qmatmul import qmatmul_kernel
from kvgen.sampling_params import SamplingParams
from tests.engine.test_continuous_batching import finished_outputs, prompts, run_all

CPU = torch.device("cpu")
ALPHA = 1e-3  # significance of the distribution tests (fixed seeds: they pass or fail deterministically)
STORY = "Lily and Tom went to the park. They saw a big ball. Lily and Tom played with the ball in the park."


@pytest.fixture(scope="module")
def loaded(stories_bin):
    return load_model(stories_bin)


def spec_options(method: str, k: int, stories_bin) -> dict:
    """method: "ngram", "draft" (the draft model alone) or "draft+suffix" (the engine's default for a
    draft: the suffix tree proposes where it matches, kvgen/engine/speculative/hybrid.py)."""
    name, _, paired = method.partition("+")
    options = dict(speculative_method=name, num_speculative_tokens=k, adaptive_speculation=False)
    if name == "draft":  # self-speculation: a 4-bit copy of the fp32 target
        options |= dict(draft_model=str(stories_bin), draft_quantization="int4",
                        draft_suffix_match=EngineConfig.draft_suffix_match if paired else 0)
    return options


def engine(loaded, **options) -> LLMEngine:
    config = EngineConfig(**options)
    return LLMEngine(loaded, config, loaded if config.speculative_method == "draft" else None)


def ragged_requests(count: int, seed: int = 0) -> list[tuple[str, SamplingParams]]:
    """Mixed lengths, some opting out, a window, n = 2, logprobs and penalties."""
    rng = random.Random(seed)
    requests = []
    for i, text in enumerate(prompts(count, seed=seed, longest=60)):
        extra = [{}, {"speculative": False}, {"kv_policy": "window:24"}, {"n": 2}, {"logprobs": 2},
                 {"repetition_penalty": 1.3}][i % 6]
        requests.append((text if i % 4 else STORY, SamplingParams(temperature=0, max_tokens=rng.randint(4, 32),
                                                                  **extra)))
    return requests


def assert_clean(eng: LLMEngine) -> None:
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["ngram", "draft", "draft+suffix"])
def test_greedy_alone_equals_plain(loaded, stories_bin, method, k):
    requests = [(p, SamplingParams(temperature=0, max_tokens=64)) for p in (STORY, "Once upon a time", "")]
    plain = [run_all(engine(loaded), [r])[0] for r in requests]
    for request, want in zip(requests, plain):
        eng = engine(loaded, **spec_options(method, k, stories_bin))
        assert run_all(eng, [request])[0] == want
        assert_clean(eng)
        assert eng.speculator.counters.proposed > 0
    assert eng.stats().spec_accepted > 0 or method == "ngram"


@pytest.mark.skipif(f32_kernel() is None or paged_decode_for("auto", CPU, torch.float32) is None,
                    reason="needs kvgen's fp32 matmul (AVX-512) and attention kernels")
@pytest.mark.parametrize("method", ["ngram", "draft", "draft+suffix"])
def test_greedy_speculation_keeps_the_plain_log_probabilities_bit_for_bit(stories_bin, method):
    """A verify chunk's queries attend in place, each as the decode of its token would, and the fp32
    matmuls give a row the same bits whatever rows are beside it: so speculation changes not only
    no token but no bit of a log-probability."""
    texts = [STORY, "Once upon a time", "Lily"]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=3, ignore_eos=True)
    plain = LLM(stories_bin, enable_prefix_caching=False).generate(texts, params)
    llm = LLM(stories_bin, enable_prefix_caching=False, **spec_options(method, 4, stories_bin))
    spec = llm.generate(texts, params)
    assert llm.engine.stats().spec_accepted > 0
    for got, want in zip(spec, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs  # floats compared exactly


@pytest.mark.parametrize("method, k", [("ngram", 3), ("draft", 3), ("draft+suffix", 3),
                                       *(pytest.param(m, k, marks=pytest.mark.slow)
                                         for m, k in (("ngram", 1), ("ngram", 8), ("draft", 1), ("draft", 8)))])
def test_greedy_ragged_batch_of_32_equals_plain(loaded, stories_bin, method, k):
    requests = ragged_requests(32)
    want = finished_outputs(engine(loaded, max_num_batched_tokens=64), requests)
    eng = engine(loaded, max_num_batched_tokens=64, **spec_options(method, k, stories_bin))
    got = finished_outputs(eng, requests)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [o.outputs[0].logprobs is None for o in got] == [o.outputs[0].logprobs is None for o in want]
    assert_clean(eng)
    stats = eng.stats()
    assert stats.spec_accepted > 0 and stats.spec_proposed >= stats.spec_accepted
    opted_out = [o for o, (_, p) in zip(got, requests) if p.speculative is False]
    assert all(o.metrics.spec_proposed == 0 for o in opted_out)


@pytest.mark.parametrize("method", ["ngram", "draft", "draft+suffix"])
def test_greedy_under_preemption_equals_plain_and_leaks_nothing(loaded, stories_bin, method):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    requests = [(t, params) for t in prompts(12, seed=1, longest=40)]
    want = run_all(engine(loaded), requests)
    tight = engine(loaded, num_kv_blocks=24, block_size=8, **spec_options(method, 4, stories_bin))
    assert run_all(tight, requests) == want
    assert tight.scheduler.num_preemptions > 0
    assert_clean(tight)


def test_abort_while_speculating_frees_every_block(loaded, stories_bin):
    eng = engine(loaded, **spec_options("draft", 3, stories_bin))
    for i, text in enumerate(prompts(6, seed=2)):
        eng.add_request(str(i), text, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.speculator.counters.verify_steps > 0
    for i in range(6):
        eng.abort(str(i))
    assert_clean(eng)
    assert not eng.speculator.proposer.computed


def test_rejected_tokens_never_reach_the_prefix_cache(loaded, stories_bin):
    """Every hashed block holds the verified tokens of its sequence: a second run of the same prompt
    served from the cache gives the same text."""
    eng = engine(loaded, block_size=4, **spec_options("ngram", 8, stories_bin))
    params = SamplingParams(temperature=0, max_tokens=40)
    first = run_all(eng, [(STORY, params)])[0]
    full = eng.encode_prompt(STORY) + first
    again = run_all(eng, [(full[:-1], SamplingParams(temperature=0, max_tokens=1))])[0]
    assert again == full[-1:] and eng.kv.prefix_hits > 0
    assert_clean(eng)


def _second_and_third_tokens(eng: LLMEngine, params: dict, seeds: int) -> tuple[list[int], list[int]]:
    requests = [(STORY, SamplingParams(seed=s, max_tokens=3, ignore_eos=True, **params)) for s in range(seeds)]
    outs = finished_outputs(eng, requests)
    return [o.token_ids[1] for o in outs], [o.token_ids[2] for o in outs]


def _homogeneous(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples come from one distribution (bins of < 5
    expected pooled into one)."""
    counts = {t: [a.count(t), b.count(t)] for t in set(a) | set(b)}
    big = [c for c in counts.values() if sum(c) >= 10]
    rest = [sum(c[0] for c in counts.values() if sum(c) < 10), sum(c[1] for c in counts.values() if sum(c) < 10)]
    table = big + ([rest] if sum(rest) else [])
    return chi2_contingency(table).pvalue


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_keeps_the_target_distribution(loaded, stories_bin, method):
    """The first token comes from the prompt's pass; the second and third are the first ones verified
    (the draft proposes 2 each time). Against plain sampling, over 1000 seeds: a chi-square test of
    homogeneity at significance 0.001, with temperature, top-k, top-p, min-p and a penalty."""
    seeds = 1000
    params = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    options = dict(max_num_seqs=256, max_num_batched_tokens=1024)
    plain = _second_and_third_tokens(engine(loaded, **options), params, seeds)
    eng = engine(loaded, **options, **spec_options(method, 2, stories_bin))
    spec = _second_and_third_tokens(eng, params, seeds)
    assert eng.speculator.counters.accepted > 50
    assert eng.speculator.counters.accepted < eng.speculator.counters.proposed  # rejections happened too
    for want, got in zip(plain, spec):
        assert _homogeneous(want, got) > ALPHA
    assert _homogeneous(plain[0], plain[1]) < ALPHA  # the test can tell two different distributions apart


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 33, True])
def test_bad_number_of_speculative_tokens_is_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..32"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=k)


def test_bad_speculative_options_are_refused():
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="paged KV cache"):
        EngineConfig(speculative_method="ngram", kv_cache="contiguous")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)


@pytest.mark.skipif(qmatmul_kernel() is None, reason="needs the quantized kernel (AVX-512 VNNI or AVX2)")
def test_a_packed_draft_quantizes_activations_to_one_int8_part(loaded, stories_bin):
    """The draft only steers proposals: one int8 part per 32 values of x (as ggml), half the integer
    kernel's work; an int4 target keeps two (its outputs are the ones that count)."""
    eng = engine(loaded, quantization="int4", **spec_options("draft", 3, stories_bin))
    draft = {k for k, _ in eng.speculator.proposer.model.kernels().values() if k.startswith("qmatmul")}
    target = {k for k, _ in eng.runner.model.kernels().values() if k.startswith("qmatmul")}
    assert draft and all(re.search(r"\(x int8[;)]", k) for k in draft), draft  # ";": a bf16 path follows
    assert target and all(re.search(r"\(x int8x2[;)]", k) for k in target), target


@pytest.mark.parametrize("p_min", [0.0, 1.0])
def test_a_draft_stops_after_a_token_it_is_unsure_of(loaded, stories_bin, p_min):
    """After a token the draft gives less than draft_p_min it proposes no more this step: with a bar
    of 1 and an unsure draft, one token a verify; with none, more. The greedy tokens are the plain engine's."""
    request = (STORY, SamplingParams(temperature=0, max_tokens=40))
    eng = engine(loaded, draft_p_min=p_min, **spec_options("draft", 4, stories_bin))
    assert run_all(eng, [request])[0] == run_all(engine(loaded), [request])[0]
    counters = eng.speculator.counters
    assert counters.verify_steps > 0
    assert (counters.proposed == counters.verify_steps) == (p_min == 1.0)


@pytest.mark.skipif(qmatmul_kernel() is None, reason="needs the quantized kernel (AVX-512 VNNI or AVX2)")
def test_a_drafts_weights_default_to_int4_on_the_cpu(loaded, stories_bin):
    """draft_quantization 'auto': on the CPU the draft's matrices take the int4 kernel (its numbers only
    steer proposals), here a float checkpoint's; a mode asked for is kept."""
    assert EngineConfig().draft_weights == "int4"
    assert EngineConfig(draft_quantization="none").draft_weights == "none"
    eng = engine(loaded, speculative_method="draft", draft_model=str(stories_bin), num_speculative_tokens=3,
                 draft_suffix_match=0)
    kernels = eng.speculator.proposer.model.kernels()
    kernels.pop("down")  # 172 columns, not a multiple of 32: stays float
    assert all(kernel.startswith("qmatmul_u4") for kernel, _ in kernels.values()), kernels


@pytest.mark.skipif(qmatmul_kernel() is None, reason="needs the quantized kernel (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_target_in_one_int8_part_speculates_exactly(loaded, stories_bin, method):
    """activations="int8" (as llama.cpp): the target's packed layers read x in one part at every row
    count, so a verify's rows are the plain decode's, and speculation gives its greedy tokens."""
    one_part = dict(quantization="int4", activations="int8")
    requests = [(p, SamplingParams(temperature=0, max_tokens=48)) for p in (STORY, "Once upon a time")]
    plain = engine(loaded, **one_part)
    target = {k for k, _ in plain.runner.model.kernels().values() if k.startswith("qmatmul")}
    assert target and all(re.search(r"\(x int8[;)]", k) for k in target), target
    want = [run_all(plain, [r])[0] for r in requests]
    spec = [run_all(engine(loaded, **one_part, **spec_options(method, 3, stories_bin)), [r])[0] for r in requests]
    assert spec == want


def test_unknown_activation_quantization_is_refused():
    with pytest.raises(ValueError, match=r"activations must be one of \('int8x2', 'int8'\), got 'int4'"):
        EngineConfig(activations="int4")


def test_a_draft_with_another_vocabulary_is_refused(loaded, hf_model):
    path, _ = hf_model("llama-gqa")  # vocabulary 320, stories260K's 512
    config = EngineConfig(speculative_method="draft", draft_model=str(path))
    with pytest.raises(ModelLoadError, match="vocabulary has 320 tokens, the target's 512"):
        LLMEngine(loaded, config, load_model(path))


def test_speculative_requests_on_an_engine_without_it_are_refused(loaded):
    eng = engine(loaded)
    with pytest.raises(InvalidRequestError, match="runs without speculative decoding"):
        eng.add_request("a", "hi", SamplingParams(speculative=True))
    eng.add_request("b", "hi", SamplingParams(speculative=False, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="speculative must be"):
        SamplingParams(speculative="yes")


@pytest.mark.parametrize("policy", ["sinks:4,28", "h2o:8,24"])
def test_sinks_and_h2o_must_opt_out(loaded, stories_bin, policy):
    eng = engine(loaded, **spec_options("ngram", 3, stories_bin))
    with pytest.raises(InvalidRequestError, match="does not compose with speculative decoding"):
        eng.add_request("a", STORY, SamplingParams(kv_policy=policy))
    params = SamplingParams(kv_policy=policy, speculative=False, temperature=0, max_tokens=40)
    assert run_all(eng, [(STORY, params)]) == run_all(engine(loaded), [(STORY, params)])
    assert eng.speculator.counters.proposed == 0


def test_grammar_requests_are_not_speculated(loaded, stories_bin):
    from kvgen.sample.grammar import GrammarSpec

    eng = engine(loaded, **spec_options("ngram", 3, stories_bin))
    params = SamplingParams(temperature=0, max_tokens=12, grammar=GrammarSpec.choice(["Lily", "Tom"]))
    assert run_all(eng, [(STORY, params)]) == run_all(engine(loaded), [(STORY, params)])
    assert eng.speculator.counters.proposed == 0


def test_a_verify_chunk_stays_below_the_prefill_kernels_rows(loaded):
    """From FUSED_BELOW_ROWS rows a step runs the prefill kernels, whose sums differ from decode's: a K
    that asks for more is cut so that a sequence's verify chunk stays on the decode kernels."""
    eng = engine(loaded, speculative_method="ngram", num_speculative_tokens=20)
    assert eng.speculator.k == MAX_EXACT_TOKENS and MAX_EXACT_TOKENS + 1 < FUSED_BELOW_ROWS
    # the cap is only as good as every row-count switch of the decode path sitting at or above it
    switches = (IN_PLACE_QUERIES, MANY_ROWS, BF16_FROM_ROWS, DECODED_FROM_ROWS, *FP32_FROM_ROWS.values())
    assert min(switches) >= FUSED_BELOW_ROWS
    assert engine(loaded, speculative_method="ngram", num_speculative_tokens=4).speculator.k == 4


# -- the adaptive switch --------------------------------------------------------------------------


def test_adaptive_switch_takes_the_faster_arm_per_batch_size_and_probes_the_other():
    switch = AdaptiveSwitch()
    rates = {(1, True): 200.0, (1, False): 100.0, (32, True): 900.0, (32, False): 1500.0}
    choices = {1: [], 32: []}
    for _ in range(3 * PROBE_EVERY):
        for batch in (1, 32):
            on = switch.decide(batch)
            choices[batch].append(on)
            switch.record(batch, on, int(rates[batch, on]), 1.0)
    for batch, faster in ((1, True), (32, False)):
        settled = choices[batch][2 * MIN_SAMPLES:]
        assert settled.count(faster) == len(settled) - settled.count(not faster)
        assert 0 < settled.count(not faster) <= len(settled) // PROBE_EVERY + 1  # the probes


def test_adaptive_switch_probes_less_often_while_its_choice_stands_and_again_after_a_flip():
    """A probe at a large batch costs several plain steps: probes that confirm the choice are spaced
    twice as far apart each time (up to MAX_PROBE_EVERY); when the other arm gets faster, probing
    follows each probe that wins, and the choice flips within a few steps."""
    switch = AdaptiveSwitch()
    rates = {True: 900.0, False: 1500.0}
    probes = []
    for step in range(20 * PROBE_EVERY):
        on = switch.decide(32)
        if step >= 2 * MIN_SAMPLES and on:
            probes.append(step)
        switch.record(32, on, int(rates[on]), 1.0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_EVERY and len(probes) <= 6
    rates = {True: 3000.0, False: 1500.0}  # the text starts repeating its input: speculation pays
    choices = []
    for _ in range(MAX_PROBE_EVERY + PROBE_EVERY):
        on = switch.decide(32)
        choices.append(on)
        switch.record(32, on, int(rates[on]), 1.0)
    first = choices.index(True)  # the next probe, followed by more while they win
    assert all(choices[first : first + PROBE_EVERY])  # flipped at once, then held until plain is probed
    assert 0 < choices[first:].count(False) <= 3


def test_adaptive_switch_ranks_arms_by_throughput_not_by_a_typical_step():
    """Speculation yielding 9 tokens in some 50 ms steps and 1 in most others still emits ~2x plain's
    25 tok/s; a median of per-step rates (20 tok/s) would switch it off."""
    switch = AdaptiveSwitch()
    for step in range(40):
        on = switch.decide(1)
        tokens = (9 if step % 3 == 0 else 1) if on else 1
        switch.record(1, on, tokens, 0.05 if on else 0.04)
    assert switch.table()["1-1"]["speculate"] > switch.table()["1-1"]["plain"]
    assert switch.decide(1) or switch.decide(1)  # on, but for a probe of plain


@pytest.mark.parametrize("steps, bound", [(128, 1.10), (1000, 1.05)])
def test_adaptive_switch_costs_little_where_speculation_loses(steps, bound):
    """Free text on a packed model: a speculating step takes 5 plain steps' time and keeps one token.
    Trying it (MIN_SAMPLES steps: one noisy sample must not switch speculation off for good) and
    probing it within its budget must cost under 10% of plain decoding's time over a short request,
    under 5% over a long one."""
    switch = AdaptiveSwitch()
    seconds = 0.0
    for _ in range(steps):
        on = switch.decide(1)
        step = 0.05 if on else 0.01
        seconds += step
        switch.record(1, on, 1, step)
    assert seconds < bound * steps * 0.01


def test_adaptive_switch_probes_speculation_when_a_request_starts_alone():
    """The copy task: the last request's ending (its text no longer in the prompt) settled on plain;
    the next request repeats its prompt again, and its first decode step probes speculation, then
    the probes that win flip the choice within a few steps. Batches of two or more keep their
    schedule (their texts change one sequence at a time)."""
    switch = AdaptiveSwitch()
    for batch, rates in ((1, {True: 50.0, False: 150.0}), (2, {True: 100.0, False: 300.0})):
        for _ in range(4 * PROBE_EVERY):
            on = switch.decide(batch)
            switch.record(batch, on, int(rates[on]), 1.0)
    while switch.decide(2):  # past a probe of the batch-2 bucket, if one is due
        switch.record(2, True, 100, 1.0)
    switch.record(2, False, 300, 1.0)
    switch.new_request()
    assert not switch.decide(2)
    choices = []
    for _ in range(12):
        on = switch.decide(1)
        choices.append(on)
        switch.record(1, on, 450 if on else 150, 1.0)
    assert choices[0] and all(choices[5:])


def settle_on_plain(switch: AdaptiveSwitch) -> None:
    """Speculation measured at a third of plain decoding's rate, past any probe that is due."""
    for _ in range(4 * PROBE_EVERY):
        on = switch.decide(1)
        switch.record(1, on, 50 if on else 150, 1.0)
    while switch.decide(1):
        switch.record(1, True, 50, 1.0)
    switch.record(1, False, 150, 1.0)


def test_adaptive_switch_probes_speculation_after_a_streak_of_guessed_tokens():
    """The edit task: past the changed lines the reply copies its input again, which a model-free
    proposer's guesses show on the plain steps themselves. GUESS_STREAK guessed steps in a row probe
    speculation at the next step; a miss starts the count over; a streak's probe that loses doubles
    the streak asked next, and one that wins brings it back."""
    switch = AdaptiveSwitch()
    settle_on_plain(switch)

    def plain_steps_until_a_probe(hits: list[bool]) -> int | None:
        for step, hit in enumerate(hits):
            if switch.decide(1):
                return step
            switch.record(1, False, 150, 1.0)
            switch.guess_checked(1, hit)
        return None

    assert plain_steps_until_a_probe([True] * (GUESS_STREAK - 1) + [False] + [True] * (GUESS_STREAK - 1)) is None
    assert plain_steps_until_a_probe([True] * 8) == 1  # the missing hit, then the probe
    switch.record(1, True, 50, 1.0)  # the probe loses
    assert plain_steps_until_a_probe([True] * (4 * GUESS_STREAK)) == 2 * GUESS_STREAK
    switch.record(1, True, 1500, 1.0)  # this one wins: more probes follow at once
    assert switch.decide(1)


def test_adaptive_switch_leaves_out_a_stalled_step():
    switch = AdaptiveSwitch()
    for seconds in (0.04, 0.04, 4.0, 0.04):
        switch.record(1, False, 1, seconds)
    assert switch.table()["1-1"]["plain"] == pytest.approx(25.0)


def test_adaptive_engine_decodes_plainly_while_prompts_wait(loaded):
    speculator = engine(loaded, speculative_method="ngram", num_speculative_tokens=4).speculator
    speculator.begin_step(8, prompts_waiting=True)
    assert not speculator.active
    speculator.begin_step(8)
    assert speculator.active  # the switch tries speculating first


def test_adaptive_engine_is_still_exact(loaded):
    requests = ragged_requests(16, seed=4)
    eng = engine(loaded, speculative_method="ngram", num_speculative_tokens=4)
    assert run_all(eng, requests) == run_all(engine(loaded), requests)
    assert eng.speculator.switch.table()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_last_prompt_token_left_alone_by_chunking_is_sampled_plainly(loaded, stories_bin, method):
    """Chunked prefill can leave the last prompt token alone in a step, which looks like a decode: it
    must not be speculated (the first token forks an n = 2 request and ends prompt scoring)."""
    eng = engine(loaded, **spec_options(method, 4, stories_bin))
    num_prompt = len(eng.encode_prompt(STORY))
    options = dict(max_num_batched_tokens=num_prompt - 1, **spec_options(method, 4, stories_bin))
    params = SamplingParams(temperature=0, max_tokens=12, n=2, prompt_logprobs=1)
    want = finished_outputs(engine(loaded, max_num_batched_tokens=num_prompt - 1), [(STORY, params)])[0]
    eng = engine(loaded, **options)
    eng.add_request("0", STORY, params)
    got = None
    for _ in range(200):  # a sequence that never forked would leave the request unfinished forever
        got = next((o for o in eng.step() if o.finished), got)
    assert got is not None and not eng.has_unfinished()
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert len(got.prompt_logprobs) == num_prompt and eng.speculator.counters.verify_steps > 0
    assert_clean(eng)
