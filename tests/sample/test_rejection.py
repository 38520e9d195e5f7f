"""Rejection sampling of speculative tokens: greedy keeps the argmax prefix; sampling keeps each
emitted token distributed exactly as the target's adjusted distribution p (chi-square goodness of fit
against p itself, at significance 0.001)."""

from dataclasses import dataclass, field

import pytest
import torch
from scipy.stats import chisquare

from kvgen.sample.rejection import verify
from kvgen.sample.sampler import filtered_probs
from kvgen.sampling_params import SamplingParams

ALPHA = 1e-3  # a correct sampler fails one seed set in a thousand; the seeds are fixed, so it never flakes
VOCAB = 6
TRIALS = 12000


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2])
    output_token_ids: list[int] = field(default_factory=list)
    grammar: None = None


def test_greedy_keeps_the_prefix_that_matches_the_argmax_then_the_target_token():
    logits = torch.full((4, VOCAB), -5.0)
    logits[0, 3] = logits[1, 1] = logits[2, 4] = logits[3, 0] = 5.0  # argmax 3, 1, 4, then 0
    row = Row(SamplingParams(temperature=0))
    assert verify(logits, [3, 1, 2], None, row).token_ids == [3, 1, 4]
    assert verify(logits, [3, 1, 4], None, row).token_ids == [3, 1, 4, 0]  # all accepted: the bonus
    assert verify(logits, [2, 1, 4], None, row).token_ids == [3]


def test_greedy_applies_penalties_over_the_draft_so_far():
    """A repetition penalty at row 1 sees draft token 0 as already generated (as a lone decode would)."""
    logits = torch.tensor([[4.0, 1, 0, 0, 0, 0], [3.0, 2.9, 0, 0, 0, 0]])
    row = Row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[5])
    assert verify(logits, [0], None, row).token_ids == [0, 1]


def _target(seed: int) -> tuple[torch.Tensor, SamplingParams]:
    torch.manual_seed(seed)
    logits = torch.randn(3, VOCAB) * 1.5  # [k + 1, vocab], k = 2
    return logits, SamplingParams(temperature=0.8, top_k=5, top_p=0.95, seed=0)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target forbids was emitted"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    return chisquare(counts[support].double().numpy(), expected.double().numpy()).pvalue


@pytest.mark.parametrize("proposer", ["point mass", "draft distribution"])
def test_sampled_tokens_follow_the_target_distribution(proposer):
    logits, params = _target(7)
    p = filtered_probs(logits, [params] * 3)  # [3, vocab]: what plain sampling draws from
    torch.manual_seed(1)
    q = torch.softmax(torch.randn(2, VOCAB), dim=-1)  # the draft's own (different) distribution
    first, second = torch.zeros(VOCAB, dtype=torch.long), torch.zeros(VOCAB, dtype=torch.long)
    for trial in range(TRIALS):
        g = torch.Generator().manual_seed(trial)
        if proposer == "point mass":  # prompt lookup: always the same guess, often right at first
            draft, draft_probs = [int(p[0].argmax()), 2], None
        else:
            draft, draft_probs = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)], q
        tokens = verify(logits, draft, draft_probs, Row(params, g)).token_ids
        first[tokens[0]] += 1
        if len(tokens) > 1:  # the first was accepted: the second follows row 1 (which here ignores it)
            assert tokens[0] == draft[0]
            second[tokens[1]] += 1
    assert _chi_square(first, p[0]) > ALPHA
    assert second.sum() > 1000
    assert _chi_square(second, p[1]) > ALPHA


def test_the_chi_square_check_can_fail():
    """The same check rejects the draft's distribution: the test has the power to see a wrong sampler."""
    logits, params = _target(7)
    p = filtered_probs(logits, [params] * 3)
    counts = torch.zeros(VOCAB, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    uniform = (p[0] > 0).double() / (p[0] > 0).sum()
    for token in torch.multinomial(uniform, TRIALS, replacement=True, generator=g).tolist():
        counts[token] += 1
    assert _chi_square(counts, p[0]) < ALPHA
