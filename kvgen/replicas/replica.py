"""One data-parallel replica: a process with its own engine, KV pool and cores.

On this machine it is a fresh interpreter (kvgen.distributed.process.WorkerProcess, never fork: see
there) running `replica_main`, which pins itself to its cores; on a Ray cluster it is a Ray actor
(kvgen.replicas.ray_replica). Either way `run_replica` builds the engine, connects back to the front
end (multiprocessing.connection, with an auth key: a local socket, or TCP from a Ray actor) and
serves a small loop:

    front end -> replica    ("add", request_id, AdmittedRequest)     ("abort", request_id)   ("close",)
                            ("snapshot", token, released_since)     the dashboard asks for the engine's state
    replica -> front end    ("ready", index, host, pid, stats)
                            ("outputs", [RequestOutput, ...], stats, adds)  after every step
                            ("rejected", request_id, message)           add_admitted refused it (a 400)
                            ("stats", stats, adds)                      after adds / aborts with no step
                            (adds: how many adds it has applied, so the front end knows which of
                            those it sent are not in `stats` yet)
                            ("snapshot", token, EngineSnapshot | str)   (a str: why there is none)
                            ("alive",)     every HEARTBEAT_S from its own thread, even mid-step

Between two steps it applies what arrived (adds, then aborts: an abort gives the request's blocks
back at once); when the engine has nothing to do it blocks on the connection. A step that raises ends
the process with status 1 after telling the front end nothing more: the front end sees the connection
close, fails the replica's in-flight requests and starts a new replica (kvgen.replicas.frontend). If
the front end goes away (the connection closes), the replica exits too. The heartbeat is for what a
closing connection does not show: a replica whose node vanished or that hangs goes silent, and the
front end takes it for dead (kvgen.replicas.frontend.SILENCE_LIMIT_S).
"""

from __future__ import annotations

import os
import socket
import sys
import threading

MARKER = "kvgen-replica"  # in each replica's command line (ps, tests)
HEARTBEAT_S = 0.5


class Channel:
    """The connection to the front end, shared by the serving loop and the heartbeat thread."""

    def __init__(self, conn) -> None:  # noqa: ANN001 - a multiprocessing.connection.Connection
        self.conn = conn
        self._send_lock = threading.Lock()
        self.closed = threading.Event()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def heartbeat(self) -> None:
        """("alive",) every HEARTBEAT_S until the connection closes."""
        while not self.closed.wait(HEARTBEAT_S):
            try:
                self.send(("alive",))
            except (OSError, ValueError):  # the front end is gone: the serving loop sees it too
                return


def replica_main(index: int, address: str, authkey: bytes, cores: list[int], model: str | None,
                 tokenizer: str | None, gguf_file: str | None, config: object) -> None:
    """A replica process on this machine (kvgen.replicas.launch), pinned to `cores`."""
    os.sched_setaffinity(0, cores)  # before torch starts its OpenMP pool: its threads inherit the mask
    run_replica(index, address, authkey, len(cores), model, tokenizer, gguf_file, config)


def run_replica(index: int, address: str | tuple[str, int], authkey: bytes, threads: int, model: str | None,
                tokenizer: str | None, gguf_file: str | None, config: object) -> None:
    """Builds the engine on `threads` torch threads, connects to the front end at `address` and serves
    it until it says close or goes away. Run in a local replica process, or in a Ray actor
    (kvgen.replicas.ray_replica), where `address` is the front end's TCP address."""
    import logging

    import torch

    import kvgen  # noqa: F401 - thread settings first (kvgen.threads)
    from multiprocessing.connection import Client

    from kvgen.llm import open_engine
    from kvgen.loaders.residency import freeze_live_objects

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"replica {index}: %(levelname)s: %(message)s")
    engine = open_engine(model, config, tokenizer, gguf_file)[0]  # as a single process's, heap settings too
    freeze_live_objects()
    conn = Client(address, authkey=authkey)
    channel = Channel(conn)
    try:
        channel.send(("ready", index, socket.gethostname(), os.getpid(), engine.stats()))
        threading.Thread(target=channel.heartbeat, name="kvgen-replica-heartbeat", daemon=True).start()
        _serve(engine, channel)
    except (EOFError, OSError):  # the front end went away
        pass
    finally:
        channel.closed.set()
        conn.close()


def _serve(engine, channel: Channel) -> None:  # noqa: ANN001 - the engine's types live in the child only
    from kvgen.errors import InvalidRequestError

    conn, adds = channel.conn, 0
    while True:
        # Block for a message only when there is nothing to step.
        while conn.poll(0) or not engine.has_unfinished():
            message = conn.recv()
            kind = message[0]
            if kind == "close":
                return
            if kind == "add":  # admitted by the front end, under this engine's rules
                _, request_id, admitted = message
                adds += 1
                try:
                    engine.add_admitted(request_id, admitted)
                except InvalidRequestError as error:
                    channel.send(("rejected", request_id, str(error)))
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "snapshot":  # the dashboard's view of this replica, between two steps
                _, token, released_since = message
                channel.send(("snapshot", token, _snapshot(engine, released_since)))
            if not conn.poll(0) and not engine.has_unfinished():
                channel.send(("stats", engine.stats(), adds))
        try:
            outputs = engine.step()
        except Exception as error:  # noqa: BLE001 - a broken engine: the front end restarts the replica
            print(f"kvgen replica: a step failed: {error!r}", file=sys.stderr, flush=True)
            os._exit(1)
        channel.send(("outputs", outputs, engine.stats(), adds))


def _snapshot(engine, released_since: int):  # noqa: ANN001, ANN202
    from kvgen.engine.snapshot import take_snapshot

    try:
        return take_snapshot(engine, released_since=released_since)
    except Exception as error:  # noqa: BLE001 - the dashboard's request fails, not the replica
        return f"the replica could not take a snapshot: {error!r}"
