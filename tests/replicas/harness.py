"""What the replica tests share: `kvgen serve --data-parallel-size 2` as a real subprocess on a free
loopback port (local replica processes, or Ray actors), its replicas' processes, and its /metrics."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvgen.replicas.launch import REPLICA_ENV
from tests.support.servers import wait_healthy

API_KEY = "test-key"
MODEL = "stories260K"
ENGINE_ARGS = ["--num-kv-blocks", "256", "--max-num-seqs", "32"]
ENGINE_OPTIONS = {"num_kv_blocks": 256, "max_num_seqs": 32}
STOP_TIMEOUT_S = 20.0

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install 'kvgen[ray]')")
RAY_LOCAL = ("--ray-address", "local")  # a private one-machine Ray instance, started and stopped with the server
# The replicas as local processes, then as Ray actors: slow (Ray's start adds ~10 s to each server),
# but for the faults (FAULT_BACKENDS), where the two differ most, in the default suite too.
BACKENDS = [pytest.param((), id="local"), pytest.param(RAY_LOCAL, id="ray", marks=[needs_ray, pytest.mark.slow])]
FAULT_BACKENDS = [pytest.param((), id="local"), pytest.param(RAY_LOCAL, id="ray", marks=[needs_ray])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicas_of(front_end: int) -> dict[int, psutil.Process]:
    """The live replica processes of the front end with pid `front_end`, by index: found by the
    marker in their environment, wherever they were started from (a local replica is the front end's
    child, a Ray actor the raylet's)."""
    found = {}
    for p in psutil.process_iter():
        try:
            owner, _, index = p.environ().get(REPLICA_ENV, "").partition("/")
            if owner == str(front_end) and p.status() != psutil.STATUS_ZOMBIE:
                found[int(index)] = p
        except psutil.Error:
            continue
    return found


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `processes` still running (not exited, not a zombie) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@contextmanager
def serve(*options: str, model_args: tuple[str, ...] = (), start_timeout: float = 120,
          env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kvgen serve` with two replicas on a free loopback port; on exit SIGTERM, and no replica is left."""
    port = free_port()
    command = [sys.executable, "-m", "kvgen", "serve", "--port", str(port), "--api-key", API_KEY,
               "--data-parallel-size", "2", *(model_args or ENGINE_ARGS), *options]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server that logs much would block on a full one
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    replicas: list[psutil.Process] = []
    try:
        wait_healthy(url, proc, start_timeout, lambda: (log.seek(0), log.read())[1])
        replicas = list(replicas_of(proc.pid).values())
        assert len(replicas) == 2
        yield url, proc
    finally:
        replicas += list(replicas_of(proc.pid).values()) if proc.poll() is None else []
        proc.terminate()  # SIGTERM to the front end stops every replica
        proc.wait(timeout=60)
        log.close()
        alive = wait_gone(replicas, STOP_TIMEOUT_S)
        assert not alive, f"replicas left running: {alive}"


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def per_replica(url: str, name: str) -> list[float]:
    values = metrics(url)
    return [values[(name, (("replica", str(i)),))] for i in range(2)]


def client(url: str, timeout: float = 120) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)


# -- a mix of requests, run all at once: greedy answers to compare between servers ------------------

def mixed_requests(count: int, starts: list[str]) -> list[dict]:
    """`count` (even) mixed requests over `starts`: completions and chats, streamed or not, several
    lengths, one with n=2 and one with a prompt list (so count + 1 engine requests)."""
    out = []
    for i in range(count // 2):
        start, k = starts[i % len(starts)], i % 8
        out.append({"kind": "completion", "prompt": start, "max_tokens": 8 + 5 * k, "stream": i % 2 == 1})
        out.append({"kind": "chat", "messages": [{"role": "user", "content": start}], "max_tokens": 12 + 3 * k,
                    "stream": i % 3 == 0})
    out[2]["n"] = 2
    out[4]["prompt"] = [starts[2 % len(starts)], starts[3 % len(starts)]]
    return out


def run_request(url: str, request: dict, model: str) -> list[str]:
    """One request of mixed_requests, greedy, through the official client: its choices' texts."""
    api = client(url)
    kind, stream = request["kind"], request["stream"]
    fields = {k: v for k, v in request.items() if k not in ("kind", "stream")}
    if kind == "completion":
        if stream:
            texts: dict[int, str] = {}
            for chunk in api.completions.create(model=model, temperature=0, stream=True, **fields):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            return [texts[i] for i in sorted(texts)]
        return [c.text for c in api.completions.create(model=model, temperature=0, **fields).choices]
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       api.chat.completions.create(model=model, temperature=0, stream=True, **fields) if chunk.choices)
        return [text]
    return [c.message.content for c in api.chat.completions.create(model=model, temperature=0, **fields).choices]


def run_all(url: str, requests: list[dict], model: str) -> list[list[str]]:
    """Every request at once, each on its own thread; their answers in order."""
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        results[i] = run_request(url, requests[i], model)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


# -- a replica killed mid-load ----------------------------------------------------------------------

def kill_one_mid_load(url: str, front_end: int, model: str, max_tokens: int, prompt: str = "Once upon a time",
                      freeze: bool = False) -> dict[str, float]:
    """Four long greedy streams on a round-robin server (two per replica); replica 1 is killed
    (SIGKILL), or with `freeze` stopped (SIGSTOP: it hangs with its connection open, as when its node
    vanishes), once both replicas hold blocks. Replica 0's requests complete, replica 1's end with an
    error event and [DONE] within 5 s (it is out of routing), it is back within 30 s as a new process,
    no block stays used, and both serve again. Returns the seconds from the kill to replica 1's
    requests failing ("failed_after_s") and to its being up again ("back_after_s")."""
    replicas = replicas_of(front_end)
    results: dict[int, list[str]] = {}
    ended: dict[int, float] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                "stream": True, "temperature": 0}, timeout=120) as r:
            results[i] = [line for line in r.iter_lines() if line.startswith("data: ")]
        ended[i] = time.monotonic()

    failure = "replica 1 sent nothing for 3 s" if freeze else "replica 1 exited"
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while min(per_replica(url, "kvgen_kv_cache_blocks_used")) == 0:  # both replicas at work
        assert time.monotonic() < deadline
        time.sleep(0.02)
    replicas[1].suspend() if freeze else replicas[1].kill()
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 4 and all(lines[-1] == "data: [DONE]" for lines in results.values())
    # round-robin gave each replica two: replica 0's complete, replica 1's end with an error event
    ends = sorted("completed" if '"finish_reason":"length"' in lines[-2] else
                  "failed" if failure in lines[-2] else lines[-2] for lines in results.values())
    assert ends == ["completed", "completed", "failed", "failed"], ends
    failed_after = max(ended[i] - killed_at for i, lines in results.items() if failure in lines[-2])
    assert failed_after < 5, "the dead replica's requests did not fail within 5 s"

    while per_replica(url, "kvgen_replica_up") != [1, 1]:
        assert time.monotonic() - killed_at < 30, "the replica did not come back within 30 s"
        time.sleep(0.1)
    back_after = time.monotonic() - killed_at
    assert metrics(url)[("kvgen_replica_restarts_total", (("replica", "1"),))] == 1
    assert replicas_of(front_end)[1].pid != replicas[1].pid
    assert per_replica(url, "kvgen_kv_cache_blocks_used") == [0, 0]
    # both serve again: round-robin sends the next two requests to one each
    api = client(url)
    for _ in range(2):
        assert api.completions.create(model=model, prompt=prompt, max_tokens=4).usage.completion_tokens == 4
    assert per_replica(url, "kvgen_kv_cache_blocks_used") == [0, 0]
    return {"failed_after_s": failed_after, "back_after_s": back_after}
