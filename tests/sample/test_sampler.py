"""The batched sampler on real stories260K logits and on logits built so the answer is known."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from kvgen.sample.sampler import Sampler, apply_penalties, filtered_probs
from kvgen.sampling_params import SamplingParams

sampler = Sampler()




@dataclass
class Row:
    """What the sampler reads of a sequence (the SamplingRow protocol)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1])
    output_token_ids: list[int] = field(default_factory=list)
    grammar: None = None


def row(seed: int | None = None, **params) -> Row:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return Row(SamplingParams(seed=seed, **params), gen)


@pytest.fixture(scope="module")
def real_logits(stories_bin) -> torch.Tensor:
    """Next-token logits [vocab] of stories260K after a real prompt (a fairly flat distribution)."""
    from kvgen.loaders import load_model
    from kvgen.model.decoder import DecoderModel
    from kvgen.phases import prefill

    loaded = load_model(stories_bin)
    model = DecoderModel(loaded.config, loaded.weights)
    prompt = loaded.tokenizer.encode("Once upon a time, there was a")
    logits, _ = prefill(model, prompt)
    assert logits.shape == (512,) and torch.isfinite(logits).all()
    return logits.float()


def draw_many(logits: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n draws from one distribution: a batch of n identical rows sharing one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    rows = [Row(SamplingParams(**params), gen) for _ in range(n)]
    return torch.tensor(sampler(logits.expand(n, -1).clone(), rows).token_ids)


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def known_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# -- greedy, seeds ---------------------------------------------------------------------------


def test_greedy_and_top_k_1_take_the_argmax(real_logits):
    best = int(real_logits.argmax())
    rows = [row(temperature=0), row(top_k=1), row(seed=3, top_k=1, temperature=1.5), row(seed=4, top_k=1)]
    out = sampler(real_logits.expand(len(rows), -1).clone(), rows)
    assert out.token_ids == [best] * len(rows)
    # and over many draws top_k=1 never picks anything else
    assert set(draw_many(real_logits, 200, top_k=1, temperature=2.0).tolist()) == {best}


def test_a_tiny_temperature_is_greedy_not_a_crash(real_logits):
    # logits / 1e-45 overflow to inf and softmax gives NaN: such a temperature must act as greedy
    rows = [row(temperature=1e-45), row(seed=1, temperature=1e-7, top_p=0.5)]
    logits = (real_logits * 10).expand(2, -1).clone()
    assert sampler(logits, rows).token_ids == [int(real_logits.argmax())] * 2


def test_fixed_seed_repeats_and_another_seed_differs(real_logits):
    def run(seed: int) -> list[int]:
        r = row(seed=seed, temperature=1.0)
        return [sampler(real_logits[None].clone(), [r]).token_ids[0] for _ in range(40)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


# -- the distribution the draws follow -------------------------------------------------------


def test_draws_follow_softmax_and_temperature_changes_entropy(real_logits):
    n = 4000
    entropies = {}
    for temperature in (0.05, 1.0, 2.0):
        expected = (real_logits.double() / temperature).softmax(-1)
        got = empirical(draw_many(real_logits, n, temperature=temperature), real_logits.numel())
        # each frequency is within ~4 standard deviations of its probability
        tolerance = 4 * (expected * (1 - expected) / n).sqrt() + 2 / n
        assert ((got - expected).abs() <= tolerance).all(), (temperature, (got - expected).abs().max())
        entropies[temperature] = entropy(got)
    assert entropies[0.05] < 0.2 < entropies[1.0] < entropies[2.0]


def test_synthetic_distribution_chi_square():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    n = 5000
    counts = torch.bincount(draw_many(known_logits(probs), n, seed=7), minlength=5).double()
    expected = torch.tensor(probs, dtype=torch.float64) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # 4 degrees of freedom: p ~ 0.001


# -- filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 40, 511])
def test_top_k_keeps_exactly_k_candidates(real_logits, k):
    probs = filtered_probs(real_logits[None].clone(), [SamplingParams(top_k=k)])[0]
    kept = set(probs.nonzero().flatten().tolist())
    assert kept == set(real_logits.topk(k).indices.tolist())
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_top_k_draws_stay_in_the_top_k(real_logits):
    tokens = set(draw_many(real_logits, 1000, top_k=3, temperature=3.0).tolist())
    assert tokens == set(real_logits.topk(3).indices.tolist())


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.3, [0]), (0.7, [0, 1]), (0.76, [0, 1, 2]),
                                                (0.88, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    probs = [0.5, 0.25, 0.15, 0.1]
    order = [2, 0, 3, 1]  # shuffle so that the nucleus is not simply a prefix of the vocabulary
    logits = known_logits([probs[i] for i in order])
    got = filtered_probs(logits[None], [SamplingParams(top_p=top_p)])[0]
    kept = sorted(order[i] for i in got.nonzero().flatten().tolist())
    assert kept == nucleus
    mass = sum(probs[i] for i in nucleus)
    for j, original in enumerate(order):
        want = probs[original] / mass if original in nucleus else 0.0
        assert got[j].item() == pytest.approx(want, abs=1e-6)


def test_top_p_draws_stay_in_the_nucleus(real_logits):
    p = real_logits.softmax(-1)
    ranked = p.sort(descending=True)
    size = int((ranked.values.cumsum(-1) < 0.8).sum()) + 1  # smallest prefix whose mass reaches 0.8
    nucleus = set(ranked.indices[:size].tolist())
    assert 2 < size < 20
    tokens = set(draw_many(real_logits, 1000, top_p=0.8).tolist())
    assert tokens == nucleus


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.5, [0, 1]), (1.0, [0])])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, kept):
    logits = known_logits([0.5, 0.3, 0.15, 0.05])
    got = filtered_probs(logits[None], [SamplingParams(min_p=min_p)])[0]
    assert got.nonzero().flatten().tolist() == kept
    tokens = set(draw_many(logits, 400, min_p=min_p).tolist())
    assert tokens <= set(kept)


def test_filters_combine_per_row():
    logits = known_logits([0.4, 0.3, 0.2, 0.1]).expand(3, -1).clone()
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.65), SamplingParams()]
    got = filtered_probs(logits, params)
    assert got[0].nonzero().flatten().tolist() == [0, 1]
    assert got[1].nonzero().flatten().tolist() == [0, 1]
    assert got[2].nonzero().flatten().tolist() == [0, 1, 2, 3]


# -- penalties --------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers(real_logits):
    from transformers import RepetitionPenaltyLogitsProcessor

    # seen tokens with positive and with negative logits
    order = real_logits.argsort(descending=True)
    prompt = [1, *order[:3].tolist(), *order[-3:].tolist()]
    output = [int(order[5]), int(order[5]), int(order[-10])]
    assert (real_logits[prompt + output] > 0).any() and (real_logits[prompt + output] < 0).any()
    for penalty in (1.3, 0.7):
        r = Row(SamplingParams(repetition_penalty=penalty, temperature=0), None, prompt, output)
        ours = apply_penalties(real_logits[None].clone(), [r])[0]
        ids = torch.tensor([prompt + output])
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, real_logits[None].clone())[0]
        torch.testing.assert_close(ours, theirs)
        assert sampler(real_logits[None].clone(), [r]).token_ids[0] == int(theirs.argmax())
    # a penalty > 1 lowers the probability of every repeated token
    r = Row(SamplingParams(repetition_penalty=1.5), None, prompt, output)
    before = real_logits.softmax(-1)
    after = apply_penalties(real_logits[None].clone(), [r])[0].softmax(-1)
    assert (after[prompt + output] < before[prompt + output]).all()


def test_repetition_penalty_changes_the_greedy_choice(real_logits):
    best = int(real_logits.argmax())
    r = Row(SamplingParams(temperature=0, repetition_penalty=1e6), None, [1], [best])
    assert sampler(real_logits[None].clone(), [r]).token_ids[0] != best


def test_presence_and_frequency_penalties_as_openai_defines_them():
    vocab = 16
    logits = torch.linspace(-2, 3, vocab)[None]
    prompt, output = [1, 9], [5, 5, 5, 7]
    presence, frequency = 0.5, 0.25
    r = Row(SamplingParams(presence_penalty=presence, frequency_penalty=frequency), None, prompt, output)
    got = apply_penalties(logits.clone(), [r])[0]
    # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, c counting the generated tokens
    want = logits[0].clone()
    want[5] -= 3 * frequency + presence
    want[7] -= 1 * frequency + presence
    torch.testing.assert_close(got, want)
    assert got[9] == logits[0, 9]  # a prompt token is not penalised
    # negative values encourage repetition
    r = Row(SamplingParams(presence_penalty=-1.0), None, prompt, output)
    assert apply_penalties(logits.clone(), [r])[0][7] == pytest.approx(float(logits[0, 7]) + 1.0)


def test_penalties_leave_the_input_and_other_rows_alone(real_logits):
    logits = real_logits.expand(2, -1).clone()
    snapshot = logits.clone()
    rows = [Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), None, [1, 5], [6, 6]),
            Row(SamplingParams(), None, [1, 5], [6, 6])]
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, snapshot)
    assert torch.equal(out[1], snapshot[1]) and not torch.equal(out[0], snapshot[0])


# -- batches ----------------------------------------------------------------------------------


def test_mixed_batch_gives_each_row_its_own_parameters(real_logits):
    best = int(real_logits.argmax())
    top3 = set(real_logits.topk(3).indices.tolist())
    logits = real_logits.expand(4, -1).clone()
    seen = [best]
    for step in range(30):
        rows = [row(temperature=0),
                row(seed=step, temperature=2.0, top_k=3),
                Row(SamplingParams(temperature=0, repetition_penalty=1e6), None, [1], seen),
                row(seed=100 + step, temperature=1.0)]
        out = sampler(logits, rows).token_ids
        assert out[0] == best
        assert out[1] in top3
        assert out[2] != best
        # the sampled row draws what it would draw alone
        alone = sampler(real_logits[None].clone(), [row(seed=100 + step, temperature=1.0)]).token_ids[0]
        assert out[3] == alone


def test_a_rows_draws_do_not_depend_on_the_rest_of_the_batch(real_logits):
    def draws(batch_with) -> list[int]:
        mine = row(seed=99, temperature=1.0, top_p=0.95)
        neighbours = batch_with()
        rows = neighbours[:1] + [mine] + neighbours[1:]
        at = rows.index(mine)
        logits = real_logits.expand(len(rows), -1).clone()
        return [sampler(logits, rows).token_ids[at] for _ in range(25)]

    alone = draws(lambda: [])
    torch.manual_seed(0)
    with_unseeded = draws(lambda: [row(temperature=1.0), row(temperature=0.5, top_k=10)])
    with_seeded = draws(lambda: [row(seed=1, temperature=1.0), row(temperature=0), row(seed=2, min_p=0.1)])
    assert alone == with_unseeded == with_seeded
    assert len(set(alone)) > 1


def test_logprobs_come_from_the_raw_distribution(real_logits):
    logits = real_logits.expand(2, -1).clone()
    rows = [row(temperature=0, logprobs=3), row(temperature=0, repetition_penalty=2.0)]
    out = sampler(logits, rows)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    raw = real_logits.log_softmax(-1)
    assert lp.token_logprob == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-5)
    assert list(lp.top) == real_logits.topk(3).indices.tolist()
    assert all(math.isclose(v, float(raw[t]), abs_tol=1e-5) for t, v in lp.top.items())
