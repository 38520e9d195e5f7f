"""kvgen's own bench without what it keeps outside the engine's dependencies: without matplotlib (the
`[bench]` extra) a mode prints and writes its JSON and says which figure it did not draw; without the
peer harness (benchmarks/, a checkout's) it runs on model files, and what needs the harness says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgen.bench import harness
from kvgen.cli import main

REPO = Path(__file__).resolve().parents[2]
THROUGHPUT = ["bench", "throughput", "--model", "stories260k", "--threads", "1", "--num-requests", "2",
              "--prompt-len-range", "4", "8", "--output-len-range", "2", "4", "--batch-sizes", "2"]


def test_a_mode_without_matplotlib_writes_its_json_and_names_the_missing_figure(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from kvgen.cli import main; "
            f"sys.exit(main({THROUGHPUT + ['--output-dir', str(tmp_path)]!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "throughput.json").read_text())["mode"] == "throughput"
    assert not (tmp_path / "throughput.png").exists()
    assert "no throughput.png: matplotlib is not installed (pip install 'kvgen[bench]')" in proc.stderr


@pytest.fixture
def no_checkout(tmp_path, monkeypatch):
    """This process as an installed kvgen sees it: no `benchmarks` importable, none beside the package."""
    for name in [n for n in sys.modules if n == "benchmarks" or n.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "benchmarks", None)
    monkeypatch.setattr(harness, "CHECKOUT", tmp_path)


def test_without_a_checkout_the_bench_runs_on_files_and_the_harness_is_named(no_checkout, tmp_path, capsys):
    assert not harness.available()
    assert main([*THROUGHPUT, "--output-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "throughput.json").is_file()
    capsys.readouterr()
    assert main(["bench", "report", str(tmp_path / "out" / "throughput.json")]) == 2
    assert "kvgen bench report needs the peer harness, benchmarks/ in a kvgen checkout" in capsys.readouterr().err
    assert main([*THROUGHPUT, "--compare", "hf", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--compare needs the peer harness" in capsys.readouterr().err
