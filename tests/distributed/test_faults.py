"""Faults under tensor parallelism: a worker that dies or hangs ends the run with a clear error in
bounded time (never a silent hang), and no rank outlives the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kvgen import LLM, SamplingParams
from kvgen.distributed.group import DistributedError, free_port
from kvgen.distributed.process import MARKER

REPO = Path(__file__).resolve().parents[2]
LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
PROMPTS = [f"Once upon a time, number {i}" for i in range(8)]


def _workers(pid: int) -> list[psutil.Process]:
    """The tensor-parallel workers a kvgen process spawned (not multiprocessing's resource tracker)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if MARKER in c.cmdline()]


def _wait_gone(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those still running after `seconds` (an orphan nobody reaped counts as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in processes if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_generating(*options: str) -> tuple[subprocess.Popen, list[psutil.Process], list[str]]:
    """`kvgen generate` on two ranks, once both have joined (it printed the ranks' memory report)."""
    command = [sys.executable, "-m", "kvgen", "generate", "--tensor-parallel-size", "2", "--prompt", "Once upon",
               "--max-tokens", "480", "--ignore-eos", *options]
    run = subprocess.Popen(command, env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    lines = []
    while not lines or not lines[-1].startswith("  rank 1/2"):
        line = run.stderr.readline()
        assert line, f"kvgen exited before the ranks joined: {''.join(lines)}"
        lines.append(line)
    return run, _workers(run.pid), lines


def test_killed_worker_ends_the_cli_run_with_a_clear_error_within_30s():
    run, workers, _ = _start_generating("--distributed-timeout", "10")
    try:
        workers[0].kill()
        killed = time.monotonic()
        stderr = run.stderr.read()
        run.wait(timeout=30)
        assert time.monotonic() - killed < 30
    finally:
        run.kill()
    assert run.returncode != 0
    assert "tensor parallelism failed: worker rank 1" in stderr and "exited with code -9" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # SIGKILL: as SIGTERM, no clean-up
def test_ending_rank0_ends_its_workers(sig):
    run, workers, _ = _start_generating()
    run.send_signal(sig)
    run.wait(timeout=30)
    assert not _wait_gone(workers, 10), "a worker outlived rank 0"


@pytest.fixture
def tp_llm():
    llm = LLM(num_kv_blocks=512, max_num_seqs=8, tensor_parallel_size=2, distributed_timeout=3)
    yield llm
    llm.close()
    assert all(p.exitcode is not None for p in llm.engine.workers.workers.values())


def test_killed_worker_fails_the_requests_of_a_library_run(tp_llm):
    worker = tp_llm.engine.workers.workers[1]
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(DistributedError, match="worker rank 1"):
        tp_llm.generate(PROMPTS, LONG)
    assert time.monotonic() - started < 30
    assert not tp_llm.engine.has_unfinished()
    with pytest.raises(DistributedError):  # the engine stays down
        tp_llm.generate(PROMPTS[:1], LONG)


def test_hung_worker_times_out(tp_llm):
    worker = tp_llm.engine.workers.workers[1]
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGSTOP)).start()
    started = time.monotonic()
    with pytest.raises(DistributedError, match="hung past 3 s"):
        tp_llm.generate(PROMPTS, LONG)
    assert time.monotonic() - started < 30


def test_killed_worker_stops_the_server_after_failing_its_streams():
    port = free_port()
    command = [sys.executable, "-m", "kvgen", "serve", "--tensor-parallel-size", "2", "--port", str(port)]
    server = subprocess.Popen(command, env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not _healthy(url):
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            _workers(server.pid)[0].kill()
            killed = time.monotonic()
            rest = "\n".join(lines)
        assert "worker rank 1" in rest  # the stream ends with the reason
        stderr = server.communicate(timeout=30)[1]
        assert time.monotonic() - killed < 30
    finally:
        server.kill()
    assert server.returncode != 0 and "kvgen: error: tensor parallelism failed: worker rank 1" in stderr


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
