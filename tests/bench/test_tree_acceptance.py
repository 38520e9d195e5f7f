"""benchmarks/tree_acceptance.py: greedy acceptance of a draft chain and of token trees, simulated from
the draft's ranks of the target's tokens, and a run on stories260K as its own draft."""

from __future__ import annotations

import numpy as np

from benchmarks.tree_acceptance import accepted, main, steps, trees

K = 4
CHAIN, FORK, SPARE = trees(K)


def test_a_tree_keeps_a_second_choice_only_where_its_shape_has_one():
    ranks = np.array([0, 0, 1, 0, 2, 0])
    assert accepted(ranks, 0, K, CHAIN) == 2
    assert accepted(ranks, 0, K, FORK) == 2     # the second choice at depth 3 is not in a fork
    assert accepted(ranks, 0, K, SPARE) == 4    # one second choice anywhere
    assert accepted(np.array([1, 0, 0, 0, 0]), 0, K, FORK) == 4
    assert accepted(np.array([1, 1, 0]), 0, K, SPARE) == 1  # one second choice a path at most
    assert accepted(ranks, 4, K, SPARE) == 0    # a token the draft ranks below second ends the step
    assert accepted(np.array([0, 0]), 0, K, CHAIN) == 2  # the text ends


def test_steps_cover_every_position_with_at_most_k_plus_one_tokens_each():
    ranks = np.array([0] * 10 + [2] * 3)
    assert steps(ranks, K, CHAIN) == 2 + 3  # 5 + 5 tokens, then one each
    assert [t.verify_rows for t in (CHAIN, FORK, SPARE)] == [5, 9, 15]
    assert [len(t.draft_rows) for t in (CHAIN, FORK, SPARE)] == [K] * 3


def test_a_model_as_its_own_draft_runs_every_tree(stories_dir, capsys):
    model = str(stories_dir / "stories260K.bin")
    results = main([model, model, "--task", "random", "--prompt-len", "24", "--gen-len", "16", "--count", "2",
                    "--threads", "1", "--repeats", "1"])
    assert set(results["random"]) == {"chain", "fork", "spare"}
    tokens_a_step = [results["random"][name][0] for name in ("chain", "fork", "spare")]
    assert tokens_a_step == sorted(tokens_a_step) and 1 <= tokens_a_step[0] <= K + 1  # each keeps the one before's
    assert all(rate > 0 for _, rate in results["random"].values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("forward ms: target") and len(lines) == 4
