"""Waiting for a `kvgen serve` subprocess that tests start: shared by the server, bench and replica tests."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx
import pytest


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, output: Callable[[], str]) -> None:
    """Returns once `url`/health answers 200; fails the test with the server's `output()` if it exits
    first, or if it does not answer within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvgen serve exited with status {proc.returncode}:\n{output()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "kvgen serve did not come up"
            time.sleep(0.2)
