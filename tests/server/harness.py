"""What the server tests share: a real uvicorn server on a free loopback port, and readers of its
streams and metrics."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL = "stories260K"
ENGINE_OPTIONS = {"num_kv_blocks": 512, "max_num_seqs": 64}


@dataclass
class Server:
    url: str
    app: object

    def client(self, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}", **headers})


@contextmanager
def running(app, **config) -> Iterator[str]:
    """Runs the app on uvicorn in a background thread, on a free loopback port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent-events body; checks it ends with [DONE]."""
    payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def metric_samples(server: Server) -> dict[tuple[str, tuple], float]:
    with server.client() as http:
        text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def blocks_used(server: Server) -> float:
    return metric_samples(server)[("kvgen_kv_cache_blocks_used", ())]
