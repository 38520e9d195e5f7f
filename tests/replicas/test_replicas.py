"""`kvgen serve --data-parallel-size 2`: real replica processes behind a real front end, called over
HTTP on 127.0.0.1 with the official client. Greedy outputs equal a one-engine server's, prefix-aware
routing beats round-robin on the prefix cache, and a replica that dies fails only its own requests
and comes back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.replicas.harness import (API_KEY, BACKENDS, ENGINE_OPTIONS, FAULT_BACKENDS, MODEL, client,
                                    kill_one_mid_load, metrics, mixed_requests, per_replica, replicas_of, run_all,
                                    serve)
from tests.server.harness import running


# -- greedy parity: N=2 answers as N=1 does ----------------------------------------------------------

STORY_STARTS = ["Once upon a time", "Lily had a red ball", "Tom and his dog", "The sun was hot", "One day, a bird",
                "Sam wanted to play", "The little cat", "Mom said"]


@pytest.fixture(scope="module")
def one_engine_answers() -> list[list[str]]:
    app = create_app(LLM(**ENGINE_OPTIONS).engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        return run_all(url, mixed_requests(16, STORY_STARTS), MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_replicas_answer_as_one_engine(one_engine_answers, backend):
    with serve(*backend) as (url, _):
        assert run_all(url, mixed_requests(16, STORY_STARTS), MODEL) == one_engine_answers
        assert all(len(a) >= 1 and all(a) for a in one_engine_answers)
        values = metrics(url)
        routed = sum(values.get(("kvgen_router_requests_total", (("reason", r),)), 0) for r in ("prefix", "load"))
        assert routed == 17  # one engine request per prompt: the prompt-list request has two
        assert sum(per_replica(url, "kvgen_num_requests_running")) == 0
        assert per_replica(url, "kvgen_kv_cache_blocks_used") == [0, 0]
        assert all(v > 0 for v in per_replica(url, "kvgen_prefix_cache_queries_total"))  # both replicas served

        # What one engine does at the door, the replicas' front end does too.
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        bad = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": MODEL, "prompt": "x", "max_tokens": 100000})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]

        # The dashboard shows each replica's pool: ?replica=i
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for i in range(2):
            state = httpx.get(f"{url}/dashboard/state?replica={i}", headers=auth).json()
            assert state["pool"]["num_blocks"] == 256 and state["step"] > 0
            assert state["metrics"]["kvgen_kv_cache_blocks_total"] == 256
        assert httpx.get(f"{url}/dashboard/state?replica=2", headers=auth).status_code == 404

        # A client that goes away mid-stream: the abort reaches its replica, which gives its blocks back.
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break
        deadline = time.monotonic() + 10
        while per_replica(url, "kvgen_kv_cache_blocks_used") != [0, 0]:
            assert time.monotonic() < deadline, "the aborted request's blocks were not given back"
            time.sleep(0.1)


# -- prefix-aware routing ------------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "The old man lived in a small house near the big forest. Every morning he walked to the river to get water, "
    "and every evening he sat by the fire and told stories to the children of the village.",
    "Lily and her brother Max found a box in the garden. It was red and shiny and it had a big lock. They looked "
    "for the key under every stone and behind every tree until the sun went down.",
    "Once there was a little boat that wanted to see the sea. It sailed down the river past the farms and the "
    "towns, and every fish it met told it that the sea was very big and very blue.",
    "The bunny had a carrot and the bird had a worm. They sat on the hill and looked at the clouds. The bunny said "
    "that one cloud looked like a cake, and the bird laughed and said it looked like a hat.",
]
ORDER = [0, 0, 1, 1, 2, 2, 3, 3] * 2  # round-robin sends each system prompt to both replicas


def _prefix_hit_rate(*options: str) -> tuple[float, dict]:
    with serve(*options) as (url, _):
        api = client(url)
        for n, which in enumerate(ORDER):
            api.completions.create(model=MODEL, prompt=f"{SYSTEM_PROMPTS[which]}\nQuestion {n}: what happened?",
                                   max_tokens=4, temperature=0)
        hits = sum(per_replica(url, "kvgen_prefix_cache_hits_total"))
        queries = sum(per_replica(url, "kvgen_prefix_cache_queries_total"))
        return hits / queries, metrics(url)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_routing_beats_round_robin_on_the_prefix_cache(backend):
    prefix_rate, prefix_metrics = _prefix_hit_rate("--router", "prefix", *backend)
    round_robin_rate, rr_metrics = _prefix_hit_rate("--router", "round-robin", *backend)
    # each system prompt is computed once (4 misses) instead of once per replica (8): measured 0.65 against 0.43
    assert prefix_rate > round_robin_rate + 0.1
    assert prefix_metrics[("kvgen_router_requests_total", (("reason", "prefix"),))] >= 12
    assert rr_metrics[("kvgen_router_requests_total", (("reason", "round_robin"),))] == len(ORDER)


# -- faults ---------------------------------------------------------------------------------------------

def test_cores_that_do_not_fit_are_a_one_line_error():
    cores = len(psutil.Process().cpu_affinity())
    result = subprocess.run([sys.executable, "-m", "kvgen", "serve", "--data-parallel-size", str(cores + 1)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvgen: error: {cores + 1} replicas x 1 threads need {cores + 1} cores, but this process may run on {cores}"]
    result = subprocess.run([sys.executable, "-m", "kvgen", "serve", "--router", "prefix"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--data-parallel-size" in result.stderr


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_a_dead_replica_fails_only_its_requests_and_comes_back(backend):
    with serve("--router", "round-robin", *backend) as (url, proc):
        kill_one_mid_load(url, proc.pid, MODEL, max_tokens=480)


def test_a_replica_that_hangs_is_taken_for_dead():
    """A stopped replica keeps its connection open (as one on a vanished node does): its silence
    (no heartbeat for 3 s) fails its requests within 5 s, and it is killed and replaced."""
    with serve("--router", "round-robin") as (url, proc):
        kill_one_mid_load(url, proc.pid, MODEL, max_tokens=480, freeze=True)


def test_backpressure_and_a_killed_front_end():
    """Past --max-queued-requests sequences waiting over all replicas, 429 with Retry-After; a front end
    killed outright leaves no replica behind (each exits when its connection closes)."""
    with serve("--max-num-seqs", "1", "--max-queued-requests", "2") as (url, proc):
        statuses: list[tuple[int, str | None]] = []

        def post() -> None:
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                           json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True})
            statuses.append((r.status_code, r.headers.get("retry-after")))

        threads = [threading.Thread(target=post) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert (429, "1") in statuses and (200, None) in statuses
        assert {s for s, _ in statuses} == {200, 429}

        replicas = psutil.Process(proc.pid).children()
        assert sorted(p.pid for p in replicas) == sorted(p.pid for p in replicas_of(proc.pid).values())
        proc.kill()
        gone, alive = psutil.wait_procs(replicas, timeout=10)
        assert not alive
