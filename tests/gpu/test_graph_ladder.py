"""The CUDA-graph ladder's bookkeeping (plain Python: runs anywhere)."""

import pytest

from kvgen.gpu.graph_ladder import ladder, padded_size, padding


def test_ladder_is_fine_below_16_then_every_16_and_ends_at_the_batch_limit():
    assert ladder(1) == [1]
    assert ladder(8) == [1, 2, 4, 8]
    assert ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert ladder(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert ladder(0) == []


def test_a_step_replays_the_smallest_rung_that_holds_it():
    sizes = ladder(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 16, 32, 48, 64]
    assert padded_size(65, sizes) is None  # above the ladder: eager
    assert all(padding(n, padded_size(n, sizes)) < 16 for n in range(1, 65))
    with pytest.raises(ValueError):
        padding(5, 4)
