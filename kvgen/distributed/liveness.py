"""Liveness: rank 0 watches the workers it spawned; a worker watches rank 0.

A worker that dies marks the group broken at once (rank 0's next step fails every request with the
reason and stops). If rank 0 is stuck in a collective that does not return, it exits with the message
after `grace` seconds rather than hang. A worker whose parent is gone exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from kvgen.distributed.group import TensorParallelGroup
from kvgen.distributed.process import WorkerProcess

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2


class WorkerWatch:
    """A daemon thread that polls the worker processes of rank 0."""

    def __init__(self, workers: dict[int, WorkerProcess], group: TensorParallelGroup, grace: float) -> None:
        self.workers, self.group, self.grace = workers, group, grace
        self._stopping = threading.Event()
        group.diagnose = self.dead_worker
        self._thread = threading.Thread(target=self._watch, name="kvgen-tp-watch", daemon=True)
        self._thread.start()

    def dead_worker(self, wait: float = 1.0) -> str | None:
        """What happened to the first worker that exited, waiting up to `wait` s for one to."""
        deadline = time.monotonic() + wait
        while True:
            for rank, process in self.workers.items():
                if process.exitcode is not None:
                    return f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_SECONDS / 4)

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            reason = self.dead_worker(wait=0)
            if reason is not None:
                self.group.mark_broken(reason)
                if not self._stopping.wait(self.grace):
                    log.critical("tensor parallelism: %s; rank 0 is stuck in a collective, exiting", self.group.broken)
                    os._exit(1)
                return

    def stop(self, join_seconds: float = 5.0) -> None:
        """Lets the workers finish (they got STOP, or the group is broken), then ends any left."""
        self._stopping.set()
        deadline = time.monotonic() + join_seconds
        for process in self.workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.workers.values():
            if process.exitcode is None:
                process.terminate()
                process.join(2.0)
            if process.exitcode is None:
                process.kill()
                process.join()


def exit_with_parent() -> None:
    """Ends this (worker) process when its parent goes away without stopping it (SIGKILL, SIGTERM)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS * 5)
        os._exit(1)

    threading.Thread(target=watch, name="kvgen-tp-parent", daemon=True).start()
