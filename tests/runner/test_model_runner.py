"""The runner's layout decisions that are pure bookkeeping (the tensors are tested end to end in
tests/engine: paged equals contiguous, batched equals alone)."""

import random

from kvgen.runner.model_runner import similar_lengths


def test_similar_lengths_bounds_the_padding_of_every_group():
    rng = random.Random(0)
    widths = [rng.randint(1, 48) for _ in range(64)]
    groups = similar_lengths(widths, lambda w: w, min_fill=0.75)
    assert sorted(w for g in groups for w in g) == sorted(widths)  # each item once
    for group in groups:
        assert min(group) >= 0.75 * max(group)
    assert [max(g) for g in groups] == sorted((max(g) for g in groups), reverse=True)


def test_similar_lengths_keeps_equal_lengths_together_and_handles_none():
    assert similar_lengths([5, 5, 5], lambda w: w) == [[5, 5, 5]]
    assert similar_lengths([], lambda w: w) == []
    assert similar_lengths([40, 10, 39, 9], lambda w: w) == [[40, 39], [10, 9]]
