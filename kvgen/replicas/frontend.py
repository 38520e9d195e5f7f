"""The front end of data-parallel serving: N replica processes (kvgen.replicas.replica) behind one
object with AsyncLLM's interface, so the server's routes run on it unchanged. Where the replicas run
(this machine's cores, or a Ray cluster's nodes) is the launcher's business (kvgen.replicas.launch).

    replicas = ReplicaSet(model=..., config=EngineConfig(...), num_replicas=2)
    app = create_app(replicas, model_name=...)

What the routes read of `llm.engine` (tokenizer, admission, max_model_len, stats) is an AdmissionView
(kvgen.replicas.admission), so a request is admitted once, here, and refused (400) before it is
routed exactly as one engine would refuse it. `generate` routes the admitted request
(kvgen.replicas.router), sends it to the replica, and yields the RequestOutputs the replica sends
back after each step; closing the iteration early (a client that went away) sends an abort, which
the replica applies before its next step.

Faults: each replica's connection has a reader thread. When a replica dies its connection closes;
when it hangs or its node vanishes it goes silent (no heartbeat for SILENCE_LIMIT_S) and is killed.
Either way it is taken out of routing at once, its in-flight requests fail (ReplicaFailedError: a 500, or an
error event in a stream), its series in /metrics read as an empty pool, and a new replica is started
in its place: on the same cores, or in the same Ray bundle (again and again, with a growing pause if
it keeps dying).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

from kvgen.async_llm import RequestStream
from kvgen.config import EngineConfig
from kvgen.engine.admission import AdmittedRequest
from kvgen.engine.base import EngineStats, Prompt, sum_stats
from kvgen.engine.snapshot import EngineSnapshot
from kvgen.errors import InvalidRequestError, KVGenError
from kvgen.replicas.admission import AdmissionView
from kvgen.replicas.launch import Launcher, LocalLauncher, ReplicaProcess
from kvgen.replicas.router import PrefixRouter, RoundRobinRouter
from kvgen.sampling_params import SamplingParams

log = logging.getLogger("kvgen.replicas")
ROUTERS = ("prefix", "round-robin")
START_TIMEOUT_S = 600.0
# A replica that sends nothing this long is dead to the front end. It sends a heartbeat every
# kvgen.replicas.replica.HEARTBEAT_S from a thread of its own, even in the middle of a long step.
SILENCE_LIMIT_S = 3.0
_EMPTY = EngineStats(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=0)


@dataclasses.dataclass(frozen=True)
class ReplicaReadings:
    """The replicas as /metrics shows them, read at one moment: each replica's engine stats, whether it
    serves (up) and its restarts, by replica index, and the router's decisions by reason. Plain data:
    the server formats it (kvgen.server.metrics.ReplicaCollector)."""

    stats: list[EngineStats]
    up: list[bool]
    restarts: list[int]
    routed: dict[str, int]


class ReplicaFailedError(Exception):
    """The replica serving a request died: the request fails (500), the others go on."""


@dataclasses.dataclass(eq=False)
class _Replica:
    """One incarnation of replica `index`: a new one replaces it after it dies."""

    index: int
    process: ReplicaProcess
    conn: Connection | None = None
    host: str | None = None
    pid: int | None = None
    up: bool = False
    stats: EngineStats = dataclasses.field(default_factory=lambda: _EMPTY)
    adds_sent: int = 0     # adds sent to it; those it has not yet applied count as waiting (as AsyncLLM
    adds_applied: int = 0  # counts its queued adds): its stats say how many it has applied when taken
    inflight: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = dataclasses.field(default_factory=dict)
    snapshots: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = dataclasses.field(default_factory=dict)
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def send(self, message: tuple) -> bool:
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError, AttributeError):  # it is dying: its reader thread handles that
            return False


class ReplicaSet:
    """N engine processes behind AsyncLLM's interface (generate, num_waiting, shutdown): on this
    machine, or with `ray_address` as Ray actors on that cluster (kvgen.replicas.ray_replica)."""

    def __init__(self, *, model: str | Path | None, config: EngineConfig, num_replicas: int,
                 threads_per_replica: int | None = None, router: str = "prefix", tokenizer: str | None = None,
                 gguf_file: str | None = None, load_threshold: int | None = None,
                 start_timeout: float = START_TIMEOUT_S, ray_address: str | None = None) -> None:
        from kvgen.llm import load

        if config.tensor_parallel_size > 1:
            raise KVGenError("--data-parallel-size does not combine with --tensor-parallel-size yet")
        if config.kv_cache != "paged":
            raise KVGenError("--data-parallel-size needs the paged KV cache (--kv-cache paged)")
        if router not in ROUTERS:
            raise KVGenError(f"unknown router {router!r} (expected one of {', '.join(ROUTERS)})")
        spawn_args = (str(model) if model is not None else None, tokenizer, gguf_file, config)
        if ray_address is None:
            self.launcher: Launcher = LocalLauncher(num_replicas, threads_per_replica, spawn_args)
        else:
            from kvgen.replicas.ray_replica import RayLauncher

            self.launcher = RayLauncher(ray_address, num_replicas, threads_per_replica, spawn_args)
        self.num_replicas = num_replicas
        self.config = config
        self._lock = threading.Lock()
        self._closing = False
        self._tokens = itertools.count()
        try:
            self.engine = AdmissionView(load(model, config, tokenizer, gguf_file), config, self._total_stats)
        except BaseException:
            self.launcher.close()
            raise
        self.tokenizer = self.engine.tokenizer
        self.router = (PrefixRouter(num_replicas, config.block_size, load_threshold or config.max_num_seqs)
                       if router == "prefix" else RoundRobinRouter(num_replicas))
        self.routed = {reason: 0 for reason in (("prefix", "load") if router == "prefix" else ("round_robin",))}
        self.restarts = [0] * num_replicas
        threading.Thread(target=self._accept, name="kvgen-replica-accept", daemon=True).start()
        self.replicas: list[_Replica | None] = [None] * num_replicas
        for i in range(num_replicas):
            self.replicas[i] = self._spawn(i)
        try:
            for replica in self.replicas:
                self._wait_ready(replica, start_timeout)
        except BaseException:
            self.close()
            raise

    # -- AsyncLLM's interface -------------------------------------------------------------------

    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Routes and sends the request now and returns its outputs, one after every step of its replica
        that changed it; the last one is finished. Raises InvalidRequestError at once for a request that
        can never be served; the stream raises ReplicaFailedError when its replica dies."""
        return self.submit(self.engine.admission.admit(prompt, params), request_id)

    def submit(self, admitted: AdmittedRequest, request_id: str | None = None) -> RequestStream:
        """`generate` for a request admitted already (by `self.engine.admission`)."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            live = [r.up for r in self.replicas]
            if not any(live):
                raise ReplicaFailedError("no replica is up (they are restarting); retry later")
            index, reason = self.router.choose(admitted.token_ids, [len(r.inflight) for r in self.replicas], live)
            self.routed[reason] += 1
            replica = self.replicas[index]
            replica.inflight[request_id] = (asyncio.get_running_loop(), queue)
            replica.adds_sent += 1
        replica.send(("add", request_id, admitted))

        def done(finished: bool) -> None:
            with self._lock:
                replica.inflight.pop(request_id, None)
            if not finished and replica.up:
                replica.send(("abort", request_id))

        return RequestStream(queue, done)

    def num_waiting(self) -> int:
        """Sequences waiting in every replica's scheduler, plus requests sent that it had not yet applied
        when it last said (a step's stats may leave the front end after adds it has not read yet)."""
        with self._lock:
            return sum(r.stats.num_waiting + r.adds_sent - r.adds_applied for r in self.replicas)

    async def snapshot(self, index: int, released_since: int) -> EngineSnapshot:
        """Replica `index`'s engine as the dashboard shows it, taken by the replica between two steps;
        raises ReplicaFailedError while it is down."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            replica = self.replicas[index]
            if not replica.up:
                raise ReplicaFailedError(f"replica {index} is restarting")
            token = next(self._tokens)
            replica.snapshots[token] = (asyncio.get_running_loop(), future)
        if not replica.send(("snapshot", token, released_since)):
            raise ReplicaFailedError(f"replica {index} is restarting")
        try:
            return await future
        finally:
            with self._lock:
                replica.snapshots.pop(token, None)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stops every replica (asked to exit, then terminated, then killed); idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            replicas = [r for r in getattr(self, "replicas", []) if r is not None]
        for r in replicas:
            if r.conn is not None:
                r.send(("close",))
        deadline = time.monotonic() + 5
        for r in replicas:
            r.process.join(max(deadline - time.monotonic(), 0))
            r.process.terminate()
        for r in replicas:
            r.process.join(2)
            r.process.kill()
        self.launcher.close()

    # -- replicas -------------------------------------------------------------------------------

    def readings(self) -> ReplicaReadings:
        """What /metrics reports of the replicas, read together under one lock."""
        with self._lock:
            return ReplicaReadings(stats=[r.stats for r in self.replicas], up=[r.up for r in self.replicas],
                                   restarts=list(self.restarts), routed=dict(self.routed))

    def _total_stats(self) -> EngineStats:
        with self._lock:
            readings = [r.stats for r in self.replicas]
        return sum_stats(readings)

    def _spawn(self, index: int) -> _Replica:
        return _Replica(index, self.launcher.start(index))

    def _wait_ready(self, replica: _Replica, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not replica.ready.wait(0.1):
            status = replica.process.exit_status()
            if status is not None:
                raise KVGenError(f"replica {replica.index} exited ({status}) while starting")
            if time.monotonic() > deadline:
                replica.process.kill()
                raise KVGenError(f"replica {replica.index} did not start within {timeout:.0f} s")

    def _accept(self) -> None:
        """Takes each replica's connection as it comes up (its first message says which it is)."""
        while True:
            try:
                conn = self.launcher.listener.accept()
                _, index, host, pid, stats = conn.recv()
            except (OSError, EOFError):
                if self._closing:
                    return
                continue
            while (replica := self.replicas[index]) is None:  # __init__ is still starting the others
                time.sleep(0.01)
            replica.conn, replica.host, replica.pid, replica.stats = conn, host, pid, stats
            with self._lock:
                replica.up = not self._closing
            replica.ready.set()
            threading.Thread(target=self._read, args=(replica,), name=f"kvgen-replica-{index}", daemon=True).start()
            log.info("replica %d is up on %s (pid %d, %s)", index, host, pid, self.launcher.placements[index])

    def _read(self, replica: _Replica) -> None:
        """The replica's messages, until its connection closes (it exited, or was killed) or it goes
        silent (it hangs, or its node vanished without closing the connection): then it is killed."""
        reason = None
        try:
            while True:
                if not replica.conn.poll(SILENCE_LIMIT_S):
                    reason = f"sent nothing for {SILENCE_LIMIT_S:.0f} s, not even its heartbeat, and was killed"
                    replica.process.kill()
                    break
                message = replica.conn.recv()
                kind = message[0]
                if kind == "outputs":
                    _, outputs, stats, applied = message
                    with self._lock:
                        replica.stats, replica.adds_applied = stats, applied
                        targets = [(replica.inflight.get(o.request_id), o) for o in outputs]
                        for _, o in targets:
                            if o.finished:
                                replica.inflight.pop(o.request_id, None)
                    for target, out in targets:
                        if target is not None:
                            target[0].call_soon_threadsafe(target[1].put_nowait, out)
                elif kind == "stats":
                    with self._lock:
                        replica.stats, replica.adds_applied = message[1], message[2]
                elif kind == "snapshot":
                    _, token, snap = message
                    with self._lock:
                        target = replica.snapshots.pop(token, None)
                    if target is not None:
                        target[0].call_soon_threadsafe(_settle, target[1], snap)
                elif kind == "rejected":
                    _, request_id, error = message
                    with self._lock:
                        target = replica.inflight.pop(request_id, None)
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put_nowait, InvalidRequestError(error))
        except (EOFError, OSError):
            pass
        self._on_exit(replica, reason)

    def _on_exit(self, replica: _Replica, reason: str | None) -> None:
        replica.process.join(2)
        with self._lock:
            replica.up = False
            failed, replica.inflight = replica.inflight, {}
            snapshots, replica.snapshots = replica.snapshots, {}
            replica.stats = dataclasses.replace(_EMPTY, kv_blocks_total=replica.stats.kv_blocks_total)
            self.router.forget(replica.index)
            closing = self._closing
        for loop, future in snapshots.values():
            loop.call_soon_threadsafe(_settle, future, f"replica {replica.index} exited")
        if closing:
            return
        reason = reason or f"exited ({replica.process.exit_status() or 'status unknown'})"
        log.error("replica %d (pid %s on %s) %s; %d requests failed; restarting it", replica.index,
                  replica.pid, replica.host, reason, len(failed))
        for loop, queue in failed.values():  # one error each: a raised exception carries its own traceback
            error = ReplicaFailedError(f"replica {replica.index} {reason} while serving this request")
            loop.call_soon_threadsafe(queue.put_nowait, error)
        threading.Thread(target=self._restart, args=(replica.index,), name=f"kvgen-restart-{replica.index}",
                         daemon=True).start()

    def _restart(self, index: int) -> None:
        pause = 0.5
        while True:
            time.sleep(pause)
            with self._lock:
                if self._closing:
                    return
                replica = self._spawn(index)
                self.replicas[index] = replica
                self.restarts[index] += 1
            try:
                self._wait_ready(replica, START_TIMEOUT_S)
                return
            except KVGenError as error:
                log.error("%s; trying again", error)
                pause = min(pause * 2, 30.0)


def _settle(future: asyncio.Future, snap: EngineSnapshot | str) -> None:
    if future.done():
        return
    if isinstance(snap, str):
        future.set_exception(ReplicaFailedError(snap))
    else:
        future.set_result(snap)
