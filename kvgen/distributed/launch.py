"""Starting the ranks: kvgen spawns N - 1 workers on this machine, or joins the group torchrun made.

    one machine     rank 0 is this process; workers are fresh interpreters that import kvgen and
                    not the caller's main script (kvgen.distributed.process: a script needs no
                    `if __name__ == "__main__":` guard), meeting it at tcp://127.0.0.1:<free port>;
                    each loads its own shard
    torchrun        every process runs the same command; RANK / WORLD_SIZE / MASTER_ADDR come from
                    torchrun (env://); rank 0 goes on to serve, the others run steps inside
                    `build_engine` and exit when rank 0 stops

Threads: the ranks on one machine share its cores, so each gets cores // (ranks here) for torch
(and OpenBLAS in the spawned workers).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvgen.config import EngineConfig
from kvgen.distributed.executor import TensorParallelExecutor
from kvgen.distributed.group import (
    DistributedError,
    Rendezvous,
    TensorParallelGroup,
    check_no_group,
    default_backend,
    free_port,
    torchrun_rank,
)
from kvgen.distributed.liveness import WorkerWatch
from kvgen.distributed.process import WorkerProcess, worker_environment
from kvgen.distributed.worker import exit_now, serve_worker, worker_main
from kvgen.engine.llm_engine import LLMEngine
from kvgen.errors import KVGenError
from kvgen.loaders import LoadedModel


def local_rank_of(config: EngineConfig) -> int:
    """The rank this process loads the shard of: torchrun's RANK, else 0 (the spawning process)."""
    rank = torchrun_rank()
    if rank is None:
        return 0
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise KVGenError(f"torchrun started {world} processes but --tensor-parallel-size is "
                         f"{config.tensor_parallel_size}: they must be equal")
    return rank


def build_tensor_parallel_engine(loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
    """Rank 0's engine, over the executor that drives the group, once every rank has joined. Under
    torchrun, a worker rank serves here and exits the process when rank 0 stops."""
    world = config.tensor_parallel_size
    backend = default_backend(config.device) if config.distributed_backend == "auto" else config.distributed_backend
    rank = torchrun_rank()
    _share_cores(world if rank is None else int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if rank is not None:
        config = dataclasses.replace(config, device=_rank_device(config.device, int(os.environ.get("LOCAL_RANK", "0"))))
        group = TensorParallelGroup(Rendezvous(rank, world, backend, None, config.distributed_timeout),
                                    torch.device(config.device))
        if rank != 0:
            try:
                serve_worker(loaded, config, group)
            except DistributedError as error:
                raise SystemExit(f"kvgen: error: {error}") from None
            group.destroy()
            exit_now()
        return LLMEngine(loaded, config, executor=TensorParallelExecutor(loaded, config, group))
    if loaded.reload is None:
        raise ValueError("spawning tensor-parallel workers needs LoadedModel.reload (kvgen.llm.load sets it)")
    check_no_group()  # before spawning anyone
    meeting = Rendezvous(0, world, backend, f"tcp://127.0.0.1:{free_port()}", config.distributed_timeout)
    workers = {r: _spawn(loaded, config, dataclasses.replace(meeting, rank=r), world) for r in range(1, world)}
    try:
        group = TensorParallelGroup(meeting, torch.device(_rank_device(config.device, 0)))
    except DistributedError as error:
        dead = [f"worker rank {r} exited with code {p.exitcode}" for r, p in workers.items() if p.exitcode is not None]
        for process in workers.values():
            process.kill()
        raise DistributedError("; ".join([str(error), *dead])) from None
    watch = WorkerWatch(workers, group, grace=config.distributed_timeout)
    executor = None
    try:
        executor = TensorParallelExecutor(loaded, config, group, watch)
        return LLMEngine(loaded, config, executor=executor)
    except BaseException:
        if executor is not None:
            executor.abandon()
        else:
            watch.stop(join_seconds=0)
            group.destroy()
        raise


def _spawn(loaded: LoadedModel, config: EngineConfig, meeting: Rendezvous, world: int) -> WorkerProcess:
    rank_config = dataclasses.replace(config, device=_rank_device(config.device, meeting.rank))
    threads = max(1, torch.get_num_threads())  # already this rank's share of the cores (_share_cores)
    return WorkerProcess(worker_main, (loaded.reload, rank_config, meeting), worker_environment(threads))


def _share_cores(ranks_here: int) -> None:
    """The ranks on this machine split its cores (never more threads than torch was given)."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // ranks_here)))


def _rank_device(device: str, local_rank: int) -> str:
    """cuda -> cuda:<local rank> (one GPU per rank); an explicit index or the CPU stays."""
    parsed = torch.device(device)
    return f"cuda:{local_rank}" if parsed.type == "cuda" and parsed.index is None else device
