"""Cache policies as pure bookkeeping: parsing, budgets, RoPE positions, chunk limits, dead ranges.

Hand-worked from the module docstring's conventions: the query at index t reads key j when j <= t and
j is kept; "the last W" means t - W < j; sinks rotate by rank, capped at S + W - 1.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgen.cache.policies import CachePolicy
from kvgen.errors import InvalidRequestError


@pytest.mark.parametrize("spec, want", [
    ("full", CachePolicy()),
    ("window:8", CachePolicy("window", window=8)),
    ("sinks:4,8", CachePolicy("sinks", window=8, sinks=4)),
    ("sinks:0,40", CachePolicy("sinks", window=40, sinks=0)),
    ("h2o:16,16", CachePolicy("h2o", window=16, heavy=16)),
    ("h2o:0,5", CachePolicy("h2o", window=5, heavy=0)),
    (" window:3 ", CachePolicy("window", window=3)),
])
def test_parse_and_spec_round_trip(spec, want):
    policy = CachePolicy.parse(spec)
    assert policy == want
    assert policy.spec == spec.strip()
    assert CachePolicy.parse(policy.spec) == policy


@given(st.sampled_from(["window", "sinks", "h2o"]), st.integers(0, 10_000), st.integers(1, 10_000))
def test_round_trip_any_numbers(kind, a, w):
    spec = {"window": f"window:{w}", "sinks": f"sinks:{a},{w}", "h2o": f"h2o:{a},{w}"}[kind]
    assert CachePolicy.parse(spec).spec == spec


@pytest.mark.parametrize("spec", ["", "window", "window:", "window:0", "window:-1", "window:1,2", "window:x",
                                  "sinks:4", "sinks:4,0", "sinks:-1,4", "sinks:4,8,1", "h2o:a,b", "h2o:4",
                                  "h2o:4,0", "foo:1", "full:1", "FULL", "window:1.5"])
def test_bad_specs_are_invalid_requests(spec):
    with pytest.raises(InvalidRequestError, match="kv_policy"):
        CachePolicy.parse(spec)


def test_max_kept():
    assert CachePolicy.parse("full").max_kept is None
    assert CachePolicy.parse("window:8").max_kept == 8
    assert CachePolicy.parse("sinks:4,8").max_kept == 12
    assert CachePolicy.parse("h2o:16,8").max_kept == 24


def test_flags():
    full, window, sinks, h2o = map(CachePolicy.parse, ["full", "window:8", "sinks:4,8", "h2o:4,8"])
    assert [p.uses_cache_positions for p in (full, window, sinks, h2o)] == [False, False, True, False]
    assert [p.shares_prefixes for p in (full, window, sinks, h2o)] == [True, True, False, False]
    # Blocks computed under a window hold other K/V than full ones past the first W tokens.
    assert full.prefix_key is None
    assert window.prefix_key != full.prefix_key
    assert CachePolicy.parse("window:8").prefix_key == window.prefix_key != CachePolicy.parse("window:9").prefix_key


def test_rope_position():
    # Absolute positions for full, window and h2o.
    for spec in ("full", "window:8", "h2o:4,8"):
        policy = CachePolicy.parse(spec)
        assert [policy.rope_position(i) for i in (0, 7, 11, 12, 47, 1000)] == [0, 7, 11, 12, 47, 1000]
    # Sinks: the docstring's picture, S = 4, W = 8: the newest token always has rank S + W - 1 = 11
    # once eviction has begun (t = 47 -> rank 11), before that its index.
    sinks = CachePolicy.parse("sinks:4,8")
    assert [sinks.rope_position(i) for i in (0, 3, 4, 10, 11, 12, 47, 10**6)] == [0, 3, 4, 10, 11, 11, 11, 11]
    assert CachePolicy.parse("sinks:0,1").rope_position(5) == 0


def test_max_chunk():
    assert CachePolicy.parse("full").max_chunk(0) is None
    assert CachePolicy.parse("window:8").max_chunk(100) is None  # a window mask is chunk-independent
    for spec in ("sinks:4,8", "h2o:4,8"):  # budget 12: tokens 0..11 see everything, then one at a time
        policy = CachePolicy.parse(spec)
        assert [policy.max_chunk(s) for s in (0, 1, 5, 11, 12, 13, 500)] == [12, 11, 7, 1, 1, 1, 1]


def test_dead_range_window():
    policy = CachePolicy.parse("window:8")
    # Token 20 next reads 13..20, so 0..12 are dead.
    assert policy.dead_range(20) == (0, 13)
    assert policy.dead_range(8) == (0, 1)  # reads 1..8
    assert policy.dead_range(7) == (0, 0)  # reads 0..7
    assert policy.dead_range(0) == (0, 0)
    assert CachePolicy.parse("window:1").dead_range(5) == (0, 5)  # reads only itself


def test_dead_range_sinks():
    policy = CachePolicy.parse("sinks:4,8")
    # Docstring: t = 47 reads 0..3 and 40..47, so 4..39 are dead.
    assert policy.dead_range(47) == (4, 40)
    assert policy.dead_range(12) == (4, 5)
    assert policy.dead_range(11) == (4, 4)  # 0..11 all read: nothing dead
    assert policy.dead_range(2) == (4, 4)
    assert CachePolicy.parse("sinks:0,8").dead_range(20) == CachePolicy.parse("window:8").dead_range(20)


def test_dead_range_full_and_h2o_is_empty():
    for spec in ("full", "h2o:4,8"):  # h2o's evictions are chosen by the runner from attention scores
        policy = CachePolicy.parse(spec)
        assert [policy.dead_range(n) for n in (0, 12, 1000)] == [(0, 0)] * 3


@given(st.integers(0, 8), st.integers(1, 16), st.integers(0, 200))
def test_dead_range_matches_the_read_rule(sinks, window, t):
    """Brute force: a token is dead at t iff no query t' >= t reads it (j < S or t' - W < j)."""
    policy = CachePolicy.parse(f"sinks:{sinks},{window}")
    start, end = policy.dead_range(t)
    for j in range(t):
        read_later = j < sinks or t - window < j  # query t reads the most; later ones read less
        assert (start <= j < end) == (not read_later), (j, t)
    if policy.kind == "sinks":
        rank = policy.rope_position(t)
        kept_before = min(t, sinks) + max(0, min(t - sinks, window - 1))  # keys t reads besides itself
        assert rank == kept_before
