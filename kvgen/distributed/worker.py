"""A worker rank: its shard of the model and of the KV pools, running every step rank 0 sends.

    receive SETUP (the block count) -> build the pools -> report memory ->
    loop: STEP -> the same forward on this rank's shard | COPY -> copy-on-write | STOP -> return
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

import torch

from kvgen.config import EngineConfig
from kvgen.distributed.group import DistributedError, Rendezvous, TensorParallelGroup
from kvgen.distributed.layers import parallelize
from kvgen.distributed.liveness import exit_with_parent
from kvgen.distributed.messages import Op, StepChannel, decode_copies, decode_step
from kvgen.errors import KVGenError
from kvgen.loaders import LoadedModel
from kvgen.loaders.shard import ShardPlan
from kvgen.model.decoder import DecoderModel
from kvgen.model.kv_storage import PagedKVCache
from kvgen.runner.model_runner import build_runner

log = logging.getLogger(__name__)


def shard_model(loaded: LoadedModel, config: EngineConfig, plan: ShardPlan, group: TensorParallelGroup) -> DecoderModel:
    """This rank's model: its slices (already in `loaded`), its local head counts, the collectives."""
    model = DecoderModel(plan.local_config(), {**loaded.weights, **loaded.quantized}, config.device,
                       config.torch_dtype, config.quantization, config.fused_decode, config.activations)
    return parallelize(model, plan, group)


def memory_report(group: TensorParallelGroup, model: DecoderModel, cache: PagedKVCache) -> list[tuple[int, int]]:
    """(weight bytes, KV pool bytes) of every rank, in rank order (on every rank)."""
    weights = sum(size for _, size in model.kernels().values())
    mine = torch.tensor([weights, cache.nbytes()], dtype=torch.int64)
    return [tuple(t.tolist()) for t in group.all_gather_control(mine)]


def serve_worker(loaded: LoadedModel, config: EngineConfig, group: TensorParallelGroup) -> None:
    """Runs this rank's part of every step until rank 0 sends STOP (raises DistributedError if the
    group breaks)."""
    model = shard_model(loaded, config, loaded.shard, group)
    head_dim = model.config.head_dim
    channel = StepChannel(group, model.device, model.dtype, head_dim)
    setup = channel.receive()
    if setup.header.op != Op.SETUP:
        raise DistributedError(f"rank {group.rank} expected the set-up message, got {setup.header.op.name}")
    runner = build_runner(model, config, setup.header.arg, None)
    memory_report(group, model, runner.cache)
    while True:
        message = channel.receive()
        if message.header.op == Op.STEP:
            runner.run(decode_step(message, head_dim))
        elif message.header.op == Op.COPY:
            runner.cache.copy_blocks(decode_copies(message))
        elif message.header.op == Op.STOP:
            return


def worker_main(reload: Callable[..., LoadedModel], config: EngineConfig, meeting: Rendezvous) -> None:
    """Entry point of a worker process kvgen spawned: join the group, load this rank's shard, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s: tensor-parallel rank {meeting.rank}: %(message)s")
    exit_with_parent()
    group = TensorParallelGroup(meeting, torch.device(config.device))
    try:
        loaded = reload(shard=(meeting.rank, meeting.world))
        serve_worker(loaded, config, group)
    except DistributedError:  # the group logged why
        sys.exit(1)
    except KVGenError as error:  # a file this rank cannot read, say: rank 0 reports the exit
        log.error("%s", error)
        sys.exit(1)
    group.destroy()
    exit_now()


def exit_now(status: int = 0) -> None:
    """Ends a rank's process with `status` once its output is flushed, skipping interpreter teardown:
    tearing down gloo's threads there sometimes aborts the process ("terminate called without an
    active exception", SIGABRT), which under torchrun fails the whole job after its work is done
    (2 runs in 30 of the two-node recipe on a 2-core machine, rank 0 aborting)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
