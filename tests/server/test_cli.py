"""`kvgen serve` as a user runs it: a subprocess on a free loopback port."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx

from kvgen.cli import build_parser
from tests.support.servers import wait_healthy


def test_serve_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.max_request_bytes) == ("127.0.0.1", 8000, None, 1 << 20)
    assert not args.no_dashboard and build_parser().parse_args(["serve", "--no-dashboard"]).no_dashboard
    args = build_parser().parse_args(["serve", "--port", "9000", "--max-request-bytes", "64KiB", "--block-size", "8"])
    assert (args.port, args.max_request_bytes, args.block_size) == (9000, 64 << 10, 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvgen_serve_subprocess():
    port = free_port()
    command = [sys.executable, "-m", "kvgen.cli", "serve", "--port", str(port), "--api-key", "k",
               "--num-kv-blocks", "64"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60, proc.stderr.read)
        body = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                          json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 5}).json()
        assert body["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{url}/dashboard").status_code == 200  # the page holds no data; its data needs the key
        assert httpx.get(f"{url}/dashboard/state").status_code == 401
        state = httpx.get(f"{url}/dashboard/state", headers={"Authorization": "Bearer k"}).json()
        assert state["pool"]["num_blocks"] == 64
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "KV cache: 64 blocks x 16 tokens" in stderr
    assert "5 output tokens, TTFT" in stderr
