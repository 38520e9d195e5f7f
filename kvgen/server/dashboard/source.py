"""Where the dashboard's snapshots come from: the engine loop, between two steps, shared by every client.

However many pages are open, snapshots are taken at most `max_rate` times a second: a client asking
within that interval of the last one gets the same (coalesced). The interval also grows with what a
snapshot costs (at most `max_share`, 1%, of the time goes into taking and formatting them), so a huge pool
slows the updates rather than the engine, up to `MAX_INTERVAL_S`, so a page never goes still. The cost is
the loop thread's own CPU time: waiting for the GIL while other threads run is not the snapshot's cost,
and counting it let one busy moment stretch the interval past a minute. The last `keep` snapshots stay
retrievable by id.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from kvgen.async_llm import AsyncLLM
from kvgen.engine.base import Engine
from kvgen.engine.snapshot import EngineSnapshot, take_snapshot
from kvgen.replicas.frontend import ReplicaFailedError, ReplicaSet
from kvgen.server.dashboard.state import DashboardSnapshot, state_json
from kvgen.server.metrics import ServerMetrics

KEEPALIVE_S = 15.0
MAX_INTERVAL_S = 5.0


class DashboardSource:
    """The snapshots of one app's engine, for its dashboard's routes."""

    def __init__(self, llm: AsyncLLM | ReplicaSet, metrics: ServerMetrics, *, replica: int | None = None,
                 max_rate: float = 10.0, max_share: float = 0.01, keep: int = 16) -> None:
        """`replica`: the data-parallel replica to show (`llm` is then a ReplicaSet, and the replica
        takes each snapshot between two of its steps and sends it over)."""
        self.llm = llm
        self.replica = replica
        self.metrics = metrics
        self.max_rate = max_rate
        self.max_share = max_share
        self._ids = itertools.count(1)
        self._recent: OrderedDict[int, DashboardSnapshot] = OrderedDict()
        self._keep = keep
        self._pending: asyncio.Task | None = None
        self._last: DashboardSnapshot | None = None
        self._last_at = float("-inf")
        self._cost_s = 0.0
        self._compact: tuple[int, str] | None = None  # (snapshot id, its event payload)

    @property
    def interval(self) -> float:
        """Seconds between snapshots: 1 / max_rate, or longer where a snapshot is costly."""
        return min(max(1.0 / self.max_rate, self._cost_s / self.max_share), MAX_INTERVAL_S)

    def recent(self, snapshot_id: int) -> DashboardSnapshot | None:
        return self._recent.get(snapshot_id)

    async def take(self) -> DashboardSnapshot:
        """A new snapshot, taken at the engine loop's next pause (shared with concurrent callers)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._take())
            self._pending.add_done_callback(lambda _: setattr(self, "_pending", None))
        return await asyncio.shield(self._pending)

    async def latest(self) -> DashboardSnapshot:
        """The last snapshot if younger than `interval`, else a new one."""
        if self._last is not None and time.monotonic() - self._last_at < self.interval:
            return self._last
        return await self.take()

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: a compact state whenever something changed, at most once per `interval`."""
        sent, quiet_since = None, time.monotonic()
        while True:
            try:
                snap = await self.latest()
            except ReplicaFailedError:  # the replica is restarting: keep the page's stream open
                yield ": the replica is restarting\n\n"
                await asyncio.sleep(1.0)
                continue
            if snap.fingerprint != sent:
                sent, quiet_since = snap.fingerprint, time.monotonic()
                yield f"event: state\ndata: {self._compact_payload(snap)}\n\n"
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"
            await asyncio.sleep(max(self.interval - (time.monotonic() - self._last_at), 0.0))

    async def _take(self) -> DashboardSnapshot:
        if self.replica is None:
            return await self.llm.between_steps(self._capture)
        engine_snap = await self.llm.snapshot(self.replica, self._since())
        return self._record(engine_snap, time.thread_time())  # the front end's share: the rest is the replica's

    def _since(self) -> int:
        return self._last.engine.step if self._last is not None else 0

    def _capture(self, engine: Engine) -> DashboardSnapshot:
        started = time.thread_time()
        return self._record(take_snapshot(engine, released_since=self._since()), started)

    def _record(self, engine_snap: EngineSnapshot, started: float) -> DashboardSnapshot:
        snap = DashboardSnapshot(next(self._ids), engine_snap, self.metrics.values(engine_snap.stats))
        self._recent[snap.id] = snap
        while len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        self._last, self._last_at = snap, time.monotonic()
        self._cost_s = time.thread_time() - started
        return snap

    def _compact_payload(self, snap: DashboardSnapshot) -> str:
        """The event's JSON, formatted once per snapshot whatever the number of clients."""
        if self._compact is None or self._compact[0] != snap.id:
            started = time.thread_time()
            self._compact = (snap.id, json.dumps(state_json(snap, compact=True), separators=(",", ":")))
            self._cost_s += time.thread_time() - started
        return self._compact[1]
