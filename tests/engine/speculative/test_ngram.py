"""Prompt lookup: the latest earlier occurrence of the longest matching suffix."""

from types import SimpleNamespace

from kvgen.engine.speculative.ngram import NgramProposer, lookup


def test_longest_suffix_first_then_shorter():
    tokens = [1, 2, 3, 4, 5, 9, 3, 4, 7, 2, 3, 4]
    assert lookup(tokens, 3, 1, 3) == [5, 9, 3]  # "2 3 4" at 1 beats the later "3 4" at 6
    assert lookup(tokens, 3, 1, 2) == [7, 2, 3]  # n = 2: "3 4" latest at 6
    assert lookup(tokens, 8, 1, 3) == [5, 9, 3, 4, 7, 2, 3, 4]  # up to k, and may run into the suffix itself


def test_latest_occurrence_wins_and_min_n_bounds_the_search():
    assert lookup([5, 1, 6, 1, 7, 1], 2, 1, 1) == [7, 1]
    assert lookup([5, 1, 6, 1, 7, 1], 2, 2, 3) == []  # no earlier "7 1"
    assert lookup([4], 3, 1, 3) == []
    assert lookup([4, 4], 3, 1, 3) == [4]


def test_the_proposer_guesses_the_first_token_it_would_propose():
    seq = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 9, 3, 4, 7, 2, 3, 4])
    assert NgramProposer(1, 3).guess(seq) == 5
    assert NgramProposer(2, 3).guess(SimpleNamespace(token_ids=[5, 1, 6, 1, 7, 1])) is None
