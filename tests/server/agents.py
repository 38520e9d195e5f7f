"""`kvgen serve` on a real model in a subprocess that imports this checkout's kvgen, for the agent API
tests (Anthropic Messages, OpenAI Responses, chat completions with the model's own tool format)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.servers import wait_healthy

REPO = Path(__file__).resolve().parents[2]
KEY = "agent-key"


@contextmanager
def serve(*args: str, timeout: float = 240) -> Iterator[str]:
    """Runs `kvgen serve ARGS` on a free loopback port; yields its URL. Its log is kept in a file (a
    pipe nobody reads would fill and block the server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    log = tempfile.NamedTemporaryFile("w+", prefix="kvgen-serve-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "kvgen", "serve", "--port", str(port), "--api-key", KEY, "--no-dashboard", *args]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, lambda: Path(log.name).read_text())
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)
