"""The h2o scores the cache layer keeps: the runner adds attention to them, eviction reads them."""

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.policies import CachePolicy


def test_evicts_the_lowest_scores_outside_the_window_and_returns_dead_blocks():
    hitters = HeavyHitters("cpu", block_size=4)
    hitters.state(7, 12)
    # tokens 0..11; the window (4) keeps 8..11; of 0..7 the two best (3 and 5) are kept
    hitters.add(7, torch.arange(12), torch.tensor([0.1, 0.2, 0.3, 9.0, 0.4, 8.0, 0.5, 0.6, 1, 1, 1, 1]))
    dead = hitters.evict(7, 12, CachePolicy.parse("h2o:2,4"))
    assert dead == []  # block 0 keeps token 3, block 1 keeps token 5
    assert hitters.states[7].evicted[:8].tolist() == [True, True, True, False, True, False, True, True]
    hitters.add(7, torch.tensor([3, 5]), torch.tensor([0.0, 100.0]))
    hitters.state(7, 16)
    hitters.add(7, torch.arange(8, 12), torch.full((4,), 50.0))
    assert hitters.evict(7, 16, CachePolicy.parse("h2o:2,4")) == [0]  # token 3 drops to third place


def test_padding_keys_past_the_state_are_skipped_and_forks_copy():
    hitters = HeavyHitters("cpu", block_size=4)
    hitters.state(1, 4)
    hitters.add(1, torch.tensor([0, 1, 1 << 40]), torch.tensor([1.0, 2.0, 5.0]))
    assert hitters.states[1].scores[:2].tolist() == [1.0, 2.0]
    hitters.fork(1, 2)
    with torch.inference_mode():  # as the runner adds them
        hitters.add(2, torch.tensor([0]), torch.tensor([1.0]))
    assert hitters.states[1].scores[0] == 1.0 and hitters.states[2].scores[0] == 2.0
    hitters.forget(1)
    assert 1 not in hitters and 2 in hitters
