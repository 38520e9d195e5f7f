"""The group's collectives end in bounded time when a peer stops answering, the idle-tolerant header
group included: there only the workers, which wait for the next step, wait without bound."""

from __future__ import annotations

import multiprocessing
import threading
import time

import torch

from kvgen.distributed.group import DistributedError, Rendezvous, TensorParallelGroup, free_port

TIMEOUT = 2.0


def _join_then_hang(init_method: str) -> None:
    """Rank 1: joins the group, then never posts a receive (as a worker stopped between steps)."""
    TensorParallelGroup(Rendezvous(1, 2, "gloo", init_method, TIMEOUT), torch.device("cpu"))
    time.sleep(60)


def test_a_header_to_a_worker_that_does_not_receive_fails_within_the_timeout():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    worker = multiprocessing.get_context("spawn").Process(target=_join_then_hang, args=(init_method,), daemon=True)
    worker.start()
    group = TensorParallelGroup(Rendezvous(0, 2, "gloo", init_method, TIMEOUT), torch.device("cpu"))
    errors: list[DistributedError] = []

    def send() -> None:
        try:
            group.broadcast(torch.zeros(8, dtype=torch.int64), control=True)
        except DistributedError as error:
            errors.append(error)

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        sender.join(timeout=10 * TIMEOUT)
        assert not sender.is_alive(), f"the header send still waits after {10 * TIMEOUT:g} s"
        assert errors and "hung past 2 s" in str(errors[0]) and group.broken is not None
    finally:
        worker.kill()
        worker.join()
        group.destroy()
