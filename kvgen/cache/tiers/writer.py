"""A background thread for the disk tier's writes (kvgen.cache.tiers.disk): the engine hands a block
over and goes on computing while the thread writes its file.

Jobs run one at a time, in the order given. A `submit` waits while more than `limit` bytes of jobs are
queued (so a fast prefill cannot pile up unbounded RAM behind a slow disk). The thread starts with the
first job and ends after a second with none, so an idle tier holds no thread. `flush` waits until
every job given so far is done.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_SECONDS = 1.0


class BackgroundWriter:
    """Runs `work(key)` for each submitted key on one thread, in order."""

    def __init__(self, work: Callable[[bytes], None], limit: int) -> None:
        self.work, self.limit = work, limit
        self._cond = threading.Condition()
        self._jobs: deque[tuple[bytes, int]] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, key: bytes, nbytes: int) -> None:
        with self._cond:
            while self._queued_bytes > self.limit and (self._jobs or self._busy):
                self._cond.wait()
            self._jobs.append((key, nbytes))
            self._queued_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvgen-kv-disk-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs and not self._cond.wait_for(lambda: self._jobs, IDLE_SECONDS):
                    self._thread = None
                    return
                key, nbytes = self._jobs.popleft()
                self._busy = True
            try:
                self.work(key)
            except Exception:  # a bug must not end the thread silently: the next jobs still run
                log.exception("KV disk tier: writing a block failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._queued_bytes -= nbytes
                    self._cond.notify_all()
