"""A draft model paired with suffix decoding (kvgen/engine/speculative/hybrid.py): where the text
repeats, the suffix tree proposes and the draft does not run; elsewhere the draft proposes, its cache
caught up over the tokens it skipped; greedy output stays plain decoding's (stories260K, fp32; the
exactness cases alone, in a ragged batch and under preemption are test_speculative.py's
"draft+suffix")."""

import pytest

from kvgen.config import EngineConfig
from kvgen.engine.speculative.hybrid import SuffixFirst
from kvgen.sampling_params import SamplingParams
from tests.engine.speculative.test_speculative import STORY, assert_clean, engine, loaded, spec_options  # noqa: F401
from tests.engine.test_continuous_batching import run_all

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
