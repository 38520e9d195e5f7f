"""The tensor-parallel process group: set-up, the collectives the model and the step broadcast use,
and what happens when a rank dies.

Two groups over the same ranks:

    data      the model's all-reduces and the logits gather, the step's tensors; every op waits at
              most `timeout` seconds, so a hung rank becomes an error instead of a silent hang
    control   the fixed-size header that starts each message (gloo, CPU tensors, on every backend);
              workers wait on it between steps, so it waits as long as the server is idle

Every failed or timed-out collective marks the group broken (`DistributedError`): rank 0 fails its
requests and stops, workers exit. The ranks are one machine's processes started by kvgen
(kvgen.distributed.process) or the processes `torchrun` started on one or many machines.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvgen.errors import KVGenError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait for a peer
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait this long for the next step


class DistributedError(KVGenError):
    """The tensor-parallel group is broken: a rank died, hung, or could not be reached."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: `init_method` for spawned workers, None under torchrun (its env://)."""

    rank: int
    world: int
    backend: str
    init_method: str | None
    timeout: float = DEFAULT_TIMEOUT


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another env:// launcher) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"])
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_no_group() -> None:
    if dist.is_initialized():
        raise DistributedError("this process already runs a tensor-parallel engine (torch.distributed has "
                               "one default group per process): close it first (LLM.close())")


def default_backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class TensorParallelGroup:
    """One rank's view of the group: its rank, the collectives, and whether the group still holds."""

    def __init__(self, meeting: Rendezvous, device: torch.device) -> None:
        self.rank, self.world, self.device = meeting.rank, meeting.world, device
        self.timeout = meeting.timeout
        check_no_group()
        kwargs = {"init_method": meeting.init_method} if meeting.init_method else {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(meeting.backend, rank=meeting.rank, world_size=meeting.world,
                                    timeout=datetime.timedelta(seconds=meeting.timeout), **kwargs)
            self.data = dist.group.WORLD
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except (RuntimeError, OSError, ValueError) as error:  # DistStoreError is a RuntimeError
            raise DistributedError(f"rank {meeting.rank}: the {meeting.world} tensor-parallel ranks did not meet "
                                   f"within {meeting.timeout:g} s: {_first_line(error)}") from None
        self._broken: str | None = None
        self._lock = threading.Lock()
        # Names a dead peer, if one can be found (WorkerWatch sets it on rank 0): a lost connection
        # is reported by gloo before the dead process is reaped.
        self.diagnose: Callable[[], str | None] = lambda: None

    # -- state ----------------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        return self._broken

    def mark_broken(self, message: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = message
                log.error("tensor parallelism: %s", message)

    def check(self) -> None:
        if self._broken is not None:
            raise DistributedError(self._broken)

    # -- collectives (each raises DistributedError and marks the group broken on failure) ------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; every rank gets the same bits."""
        self._run("all-reduce", lambda: dist.all_reduce(x, group=self.data))
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape) on rank 0, in rank order; None elsewhere."""
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        self._run("gather", lambda: dist.gather(x, parts, dst=0, group=self.data))
        return parts

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._run("all-gather", lambda: dist.all_gather(parts, x, group=self.data))
        return parts

    def all_gather_control(self, x: torch.Tensor) -> list[torch.Tensor]:
        """All-gather of a small CPU tensor on the idle-tolerant group (start-up, while ranks load)."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._run("all-gather", lambda: dist.all_gather(parts, x, group=self.control))
        return parts

    def broadcast(self, x: torch.Tensor, control: bool = False) -> torch.Tensor:
        """x from rank 0 to every rank, in place. `control`: on the idle-tolerant header group, where
        only the receivers wait without bound: rank 0's send waits the group's timeout, since a gloo
        send to a worker that hangs (stopped between steps) never completes."""
        if not control:
            self._run("broadcast", lambda: dist.broadcast(x, src=0, group=self.data))
        elif self.rank == 0:
            timeout = datetime.timedelta(seconds=self.timeout)
            self._run("broadcast", lambda: dist.broadcast(x, src=0, group=self.control, async_op=True).wait(timeout))
        else:
            self._run("broadcast", lambda: dist.broadcast(x, src=0, group=self.control))
        return x

    def _run(self, what: str, op) -> None:
        self.check()
        try:
            op()
        except (RuntimeError, OSError) as error:  # gloo / NCCL report lost peers and timeouts so
            failed = (f"{what} failed on rank {self.rank} (a rank died, hung past {self.timeout:g} s, or is "
                      f"unreachable): {_first_line(error)}")
            reason = self.diagnose()
            self.mark_broken(f"{reason} ({failed})" if reason else failed)
            raise DistributedError(self._broken) from None

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):  # a broken group cannot always be torn down cleanly
                pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
