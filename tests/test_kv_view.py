"""`kvgen generate --show-kv`: the pool picture in a terminal (kvgen.kv_view)."""

import io

import numpy as np
import pytest
from rich.console import Console

from kvgen import LLM, SamplingParams
from kvgen.cache.kv_manager import CACHED, FREE, SHARED, USED, BlockStates
from kvgen.engine.snapshot import take_snapshot
from kvgen.kv_view import CELL, HOLLOW, KVView, bin_size, binned, render
from tests.test_cli import assert_user_error, run


def plain(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


@pytest.fixture(scope="module")
def running_engine():
    engine = LLM(num_kv_blocks=40, block_size=4).engine
    engine.add_request("a", "Once upon a time there was a girl", SamplingParams(max_tokens=30, n=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def test_one_cell_per_block_and_a_line_per_sequence(running_engine):
    snap = take_snapshot(running_engine)
    text = plain(render(snap, width=20), width=40)
    lines = text.splitlines()
    assert "40 blocks x 4 tokens" in lines[0] and f"step {snap.step}" in lines[0]
    grid = [line for line in lines if line and set(line) <= {CELL, HOLLOW}]
    assert [len(row) for row in grid] == [20, 20]
    assert sum(line.count("seq ") for line in lines) == 2 and "decode" in text and "full" in text
    counts = snap.blocks.counts()
    assert f"shared {counts['shared']}" in text and counts["shared"] > 0  # n = 2 shares its prompt


def test_large_pools_are_binned_by_majority():
    codes = np.array([FREE, USED, USED, SHARED, CACHED, CACHED, FREE, FREE, USED], np.int8)
    owner = np.array([-1, 7, 7, 3, -1, -1, -1, -1, 9])
    cells, owners = binned(BlockStates(codes, owner, np.zeros(9, np.int32)), 3)
    assert cells.tolist() == [USED, CACHED, FREE] and owners.tolist() == [7, 3, 9]  # a bin's first owner
    assert bin_size(100_000, width=100, max_rows=16) == 63 and bin_size(1000, 100) == 1


def test_the_view_redraws_at_a_bounded_rate(running_engine):
    console = Console(file=io.StringIO(), width=60, force_terminal=True)
    view = KVView(running_engine, console=console, max_rate=2.0)
    drawn = []
    view._live.update = lambda *a, **k: drawn.append(1)  # count the redraws, not their bytes
    for _ in range(50):
        view.update()
    view.close()
    assert len(drawn) == 1  # 50 calls within half a second: drawn once


def test_the_picture_that_stays_is_the_runs_last_with_its_sequences():
    """Drawn at every step to the end, the view keeps the last picture with the sequence in it (its
    policy shown), not the pool emptied after the request finished."""
    engine = LLM(num_kv_blocks=32, block_size=4).engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=12, kv_policy="sinks:4,8"))
    console = Console(file=io.StringIO(), width=80, color_system=None)  # not a terminal: the last picture only
    view = KVView(engine, console=console, max_rate=1e9)
    while engine.has_unfinished():
        engine.step()
        view.update()
    view.close()
    assert "sinks:4,8" in console.file.getvalue()


def test_generate_show_kv_prints_the_pool_and_the_same_text(capsys):
    args = ["--prompt", "Once upon a time", "--max-tokens", "40", "--num-kv-blocks", "32", "--block-size", "4",
            "--kv-policy", "sinks:4,16"]
    code, shown, err = run(capsys, "generate", "--show-kv", *args)
    assert code == 0, err
    code, plain_out, _ = run(capsys, "generate", *args)
    assert "KV cache: 32 blocks x 4 tokens" in shown and "sinks:4,16" in shown
    assert shown.rstrip().endswith(plain_out.rstrip())


def test_show_kv_needs_the_paged_cache(capsys):
    code, _, err = run(capsys, "generate", "--show-kv", "--kv-cache", "contiguous")
    assert_user_error(code, err, "--show-kv")
