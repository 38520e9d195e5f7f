"""A draft model paired with suffix decoding (kvgen/engine/speculative/hybrid.py): where the text
repeats, the suffix tree proposes and the draft does not run; elsewhere the draft proposes, its cache
caught up over the tokens it skipped; greedy output stays plain decoding's and sampled output the
target's distribution (stories260K, fp32; the exactness cases alone, in a ragged batch and under
preemption are test_speculative.py's "draft+suffix")."""

import pytest

from kvgen.config import EngineConfig
from kvgen.engine.speculative.hybrid import SuffixFirst
from kvgen.sampling_params import SamplingParams
from tests.engine.speculative.test_speculative import (ALPHA, STORY, _homogeneous, assert_clean, engine,  # noqa: F401
                                                       loaded, spec_options)
from tests.engine.test_continuous_batching import finished_outputs, run_all

REPEATED = f"{STORY} {STORY} {STORY[:40]}"  # the third copy's start: the tree follows the first two


def test_the_tree_proposes_where_the_text_repeats_and_the_draft_elsewhere(loaded, stories_bin):
    request = (REPEATED, SamplingParams(temperature=0, max_tokens=64))
    eng = engine(loaded, **spec_options("draft+suffix", 4, stories_bin))
    assert run_all(eng, [request])[0] == run_all(engine(loaded), [request])[0]
    proposer = eng.speculator.proposer
    assert isinstance(proposer, SuffixFirst)
    counters = eng.speculator.counters
    assert 0 < proposer.from_suffix < counters.verify_steps  # both proposed
    assert counters.accepted > 0
    assert_clean(eng)
    assert not proposer.model.computed  # the draft forgot the finished request


def test_sampling_through_the_trees_point_masses_keeps_the_target_distribution(loaded, stories_bin):
    """Where the tree proposes, its tokens are point masses (q = 1), accepted with probability p; the
    second to fourth tokens after a repeated passage, hot enough that p is often below 1, over 1000
    seeds, against plain sampling: a chi-square test of homogeneity at significance 0.001 each (as
    test_speculative.py's for the draft)."""
    prompt = f"{STORY} {STORY[:60]}"
    params = dict(temperature=1.5, max_tokens=4, ignore_eos=True)

    def later_tokens(eng) -> list[list[int]]:
        outs = finished_outputs(eng, [(prompt, SamplingParams(seed=s, **params)) for s in range(1000)])
        return [[o.token_ids[i] for o in outs] for i in (1, 2, 3)]

    options = dict(max_num_seqs=256, max_num_batched_tokens=1024)
    plain = later_tokens(engine(loaded, **options))
    eng = engine(loaded, **options, **spec_options("draft+suffix", 2, stories_bin))
    spec = later_tokens(eng)
    assert eng.speculator.proposer.from_suffix > 500
    assert 0 < eng.speculator.counters.accepted < eng.speculator.counters.proposed
    for want, got in zip(plain, spec):
        assert _homogeneous(want, got) > ALPHA
    assert _homogeneous(plain[0], plain[1]) < ALPHA  # the test can tell two different distributions apart


@pytest.mark.parametrize("prompt", [REPEATED, "Once upon a time"])
def test_a_tree_that_never_matches_enough_leaves_the_drafts_steps_as_they_were(loaded, stories_bin, prompt):
    """With a bar no match reaches, every proposal is the draft's: the same counts as the draft alone."""
    request = (prompt, SamplingParams(temperature=0, max_tokens=48))
    alone = engine(loaded, **spec_options("draft", 4, stories_bin))
    paired = engine(loaded, **spec_options("draft+suffix", 4, stories_bin) | {"draft_suffix_match": 10_000})
    assert run_all(paired, [request]) == run_all(alone, [request])
    assert paired.speculator.proposer.from_suffix == 0
    assert paired.speculator.counters.as_dict() == alone.speculator.counters.as_dict()


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_suffix_match_is_refused(bad):
    with pytest.raises(ValueError, match="draft_suffix_match"):
        EngineConfig(speculative_method="suffix", draft_suffix_match=bad)
