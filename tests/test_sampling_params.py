"""SamplingParams validation: every bad value raises InvalidRequestError naming the field."""

from __future__ import annotations

import math

import pytest

from kvgen.errors import InvalidRequestError, KVGenError
from kvgen.sampling_params import SamplingParams

BAD = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", "2"),
    ("temperature", -1), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("temperature", None),
    ("top_k", 1.5), ("top_k", "5"),
    ("top_p", 0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", math.nan), ("top_p", "0.9"),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("frequency_penalty", 2.01), ("frequency_penalty", "x"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.5), ("max_tokens", "16"), ("max_tokens", None),
    ("max_tokens", True),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", "3"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", 2),
    ("seed", "42"), ("seed", 1.5),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_invalid_request_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)
    # it is a user error the CLI and server report without a traceback, and a ValueError for Python callers
    assert isinstance(info.value, KVGenError) and isinstance(info.value, ValueError)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1, 1.0, 0, 1.0, 0.0, 16)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and not p.ignore_eos
    assert not p.greedy and not p.has_penalties


GOOD = [
    dict(temperature=0), dict(temperature=2.5), dict(top_k=-1), dict(top_k=50), dict(top_p=1), dict(top_p=1e-6),
    dict(min_p=0), dict(min_p=1), dict(repetition_penalty=0.5), dict(presence_penalty=-2), dict(frequency_penalty=2),
    dict(max_tokens=1), dict(logprobs=0), dict(logprobs=20), dict(stop=["a", "bc"]), dict(stop=None),
    dict(stop_token_ids=[2, 13]), dict(seed=0), dict(seed=-3), dict(n=4), dict(ignore_eos=True),
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[repr(g) for g in GOOD])
def test_good_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=None).stop == []


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-9).greedy  # would overflow logits / temperature to inf
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_completion_i_gets_seed_plus_i():
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    assert [p.for_completion(i).seed for i in range(3)] == [10, 11, 12]
    assert all(p.for_completion(i).n == 1 for i in range(3))
    assert p.for_completion(1).temperature == 0.7
    assert SamplingParams(n=2).for_completion(1).seed is None
