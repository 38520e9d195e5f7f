"""Where the replicas run: a launcher starts replica `index` and owns the listener its connection
comes back on; the front end (kvgen.replicas.frontend.ReplicaSet) sees only this interface.

    launcher.start(index) -> ReplicaProcess   a replica that will connect to launcher.listener
    launcher.placements[index]                where it runs, for the logs ("cores 0,1", "Ray node ...")
    launcher.close()                          after every replica is stopped

    process.exit_status()   None while it runs; else how it ended ("status -9", "Ray: ActorDiedError")
    process.join(timeout)   waits for it to end, at most `timeout` seconds
    process.terminate()     asks it to end;  process.kill(): ends it now

Two launchers: `LocalLauncher` here (fresh interpreters on this machine, each pinned to its own
cores, over a Unix socket) and `kvgen.replicas.ray_replica.RayLauncher` (Ray actors on a cluster's
nodes, over TCP). Both carry the same messages over a multiprocessing.connection (the loop in
kvgen.replicas.replica), so what differs between them is only how a replica is placed, started and
stopped: a replica's death shows as its connection closing either way, at once.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Protocol

from kvgen.distributed.process import WorkerProcess, worker_environment
from kvgen.errors import KVGenError
from kvgen.replicas.replica import MARKER, replica_main

REPLICA_ENV = "KVGEN_REPLICA"  # "<front end pid>/<index>" in each replica's environment (tests find them by it)
SpawnArgs = tuple  # (model, tokenizer, gguf_file, config): what every replica builds its engine from


class ReplicaProcess(Protocol):
    def exit_status(self) -> str | None: ...

    def join(self, timeout: float) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    listener: Listener
    authkey: bytes
    placements: list[str]

    def start(self, index: int) -> ReplicaProcess: ...

    def close(self) -> None: ...


def replica_marker(index: int) -> str:
    return f"{os.getpid()}/{index}"


def assign_cores(num_replicas: int, threads_per_replica: int | None, cores: list[int]) -> list[list[int]]:
    """Each replica's cores, `threads_per_replica` each (default: an equal share of `cores`); raises
    KVGenError when they do not fit."""
    if num_replicas < 1:
        raise KVGenError(f"--data-parallel-size must be at least 1, got {num_replicas}")
    threads = threads_per_replica if threads_per_replica is not None else max(len(cores) // num_replicas, 1)
    if threads < 1:
        raise KVGenError(f"--threads-per-replica must be at least 1, got {threads}")
    if num_replicas * threads > len(cores):
        raise KVGenError(f"{num_replicas} replicas x {threads} threads need {num_replicas * threads} cores, "
                         f"but this process may run on {len(cores)}")
    return [cores[i * threads:(i + 1) * threads] for i in range(num_replicas)]


class LocalReplica:
    """A replica process on this machine."""

    def __init__(self, process: WorkerProcess) -> None:
        self.process = process

    def exit_status(self) -> str | None:
        code = self.process.exitcode
        return None if code is None else f"status {code}"

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


class LocalLauncher:
    """Replicas as processes on this machine, each pinned to its share of this process's cores."""

    def __init__(self, num_replicas: int, threads_per_replica: int | None, spawn_args: SpawnArgs) -> None:
        self.cores = assign_cores(num_replicas, threads_per_replica, sorted(os.sched_getaffinity(0)))
        self.placements = [f"cores {','.join(map(str, c))}" for c in self.cores]
        self.spawn_args = spawn_args
        self.authkey = secrets.token_bytes(32)
        self._dir = tempfile.TemporaryDirectory(prefix="kvgen-replicas-")
        self.listener = Listener(str(Path(self._dir.name) / "front.sock"), "AF_UNIX", authkey=self.authkey)

    def start(self, index: int) -> LocalReplica:
        cores = self.cores[index]
        args = (index, self.listener.address, self.authkey, cores, *self.spawn_args)
        env = worker_environment(len(cores)) | {REPLICA_ENV: replica_marker(index)}
        return LocalReplica(WorkerProcess(replica_main, args, env, marker=f"{MARKER}-{index}", new_session=True))

    def close(self) -> None:
        self.listener.close()
        self._dir.cleanup()
