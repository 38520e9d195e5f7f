"""`kvgen bench` takes --tensor-parallel-size through the engine options (in a process of its own:
a command leaves its engine to the exit, and a process holds one tensor-parallel group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_latency_bench_on_two_ranks(tmp_path):
    command = [sys.executable, "-m", "kvgen", "bench", "latency", "--model", "stories260k", "--threads", "1",
               "--prompt-len", "16", "--gen-len", "8", "--repeats", "1", "--bandwidth-size", "8MiB",
               "--tensor-parallel-size", "2", "--output-dir", str(tmp_path)]
    run = subprocess.run(command, env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rank 1/2" in run.stderr  # every rank's weights and KV bytes at start-up
    report = json.loads((tmp_path / "latency.json").read_text())
    assert report["settings"]["engine"]["tensor_parallel_size"] == 2
