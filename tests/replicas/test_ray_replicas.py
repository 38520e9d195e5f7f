"""Replicas as Ray actors on a cluster started the way a multi-node deployment starts one
(`ray start --head`, here with this machine as its one node), and the one-line errors of --ray-address.
The tests shared with local replicas (parity, routing, a dead replica) run on both: test_replicas.py."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.replicas.harness import MODEL, client, free_port, needs_ray, per_replica, replicas_of, serve


def test_ray_address_without_ray_is_a_one_line_error():
    """As if Ray were not installed (an import of it fails): exit 2 and one line saying what to install."""
    code = ("import sys; sys.modules['ray'] = None; from kvgen.cli import main; "
            "sys.exit(main(['serve', '--data-parallel-size', '2', '--ray-address', 'local']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["kvgen: error: --ray-address needs Ray: pip install 'kvgen[ray]'"]


@contextmanager
def ray_head(env: dict[str, str]) -> Iterator[str]:
    """A one-node Ray cluster (`ray start --head --block`, 2 CPUs, in its own temp dir); yields its
    address. Stopped by SIGTERM to that command, which stops what it started (never `ray stop`,
    which would stop every Ray cluster on the machine)."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvgen-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir, "--include-dashboard", "false",
                             "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(c.name() == "raylet" for c in psutil.Process(head.pid).children()):
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


@needs_ray
@pytest.mark.slow
def test_replicas_on_a_cluster_started_with_ray_start():
    # Ray's token authentication, as a cluster would run it: the head and its clients share the token.
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    with ray_head(env) as address:
        too_many = subprocess.run([sys.executable, "-m", "kvgen", "serve", "--data-parallel-size", "2",
                                   "--threads-per-replica", "2", "--ray-address", address],
                                  capture_output=True, text=True, timeout=120, env=env)
        assert too_many.returncode == 2
        assert too_many.stderr.strip().splitlines()[-1] == (
            f"kvgen: error: 2 replicas x 2 CPUs need 4 CPUs, but the Ray cluster at {address} has 2")

        with serve("--ray-address", address, env=env) as (url, proc):
            replicas = replicas_of(proc.pid)
            assert all(proc.pid not in [a.pid for a in p.parents()] for p in replicas.values())  # Ray's, not ours
            api = client(url)
            for _ in range(2):
                assert api.completions.create(model=MODEL, prompt="Tom", max_tokens=4).usage.completion_tokens == 4
            assert per_replica(url, "kvgen_replica_up") == [1, 1]
            assert all(v > 0 for v in per_replica(url, "kvgen_prefix_cache_queries_total"))
            assert httpx.get(f"{url}/health").status_code == 200
