"""Rank 0 under tensor parallelism: the executor the engine hands each step to, which sends the
step's tensors to the workers before its own shard runs them.

The engine is the one continuous-batching engine, unchanged in what it schedules and how it pages:
the scheduler, the KV manager and every block table live on rank 0 only, and the workers hold their
heads of the same blocks. So paging, prefix caching, copy-on-write (`CopyBroadcastingKVCache` sends
the copies), bounded policies and preemption work as with one process. Heavy hitters (h2o) are
refused: their scores sum attention weights over every head, and no rank holds every head.
"""

from __future__ import annotations

import atexit
from functools import partial

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.policies import CachePolicy
from kvgen.cache.sizing import KVPlan, format_bytes
from kvgen.config import EngineConfig
from kvgen.distributed.group import DistributedError, TensorParallelGroup
from kvgen.distributed.liveness import WorkerWatch
from kvgen.distributed.messages import Header, Message, Op, StepChannel, encode_copies, encode_step
from kvgen.distributed.worker import memory_report, shard_model
from kvgen.engine.executor import Executor
from kvgen.loaders import LoadedModel
from kvgen.loaders.shard import ShardPlan
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.decoder import DecoderModel
from kvgen.runner.model_runner import BlockTables, ModelRunner, build_runner
from kvgen.scheduling.output import ScheduledChunk


class TensorParallelRunner(ModelRunner):
    """Lays out the step as one process would, sends its tensors, then runs rank 0's shard on them."""

    def __init__(self, channel: StepChannel, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel

    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int] = frozenset()) -> torch.Tensor:
        inputs = self.prepare(chunks, all_logits)
        self.channel.send(encode_step(inputs))
        return self.run(inputs)


class CopyBroadcastingKVCache(PagedKVCache):
    """Rank 0's pools: a copy-on-write copy is sent to the workers before it is made here."""

    def __init__(self, channel: StepChannel, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.channel.send(encode_copies(copies))
        super().copy_blocks(copies)


class TensorParallelExecutor(Executor):
    """The driver of a tensor-parallel group: rank 0's shard of the model and of the KV pools, the
    channel every step goes out on, and the workers (`workers`: the ones it spawned, watched)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, group: TensorParallelGroup,
                 workers: WorkerWatch | None = None) -> None:
        if loaded.shard is None:
            raise ValueError("a tensor-parallel executor needs the model loaded with its shard plan")
        self.group, self.plan, self.workers = group, loaded.shard, workers
        self._closed, self._in_step = False, False
        super().__init__(loaded, config)
        atexit.register(self.close)

    def load_model(self, loaded: LoadedModel, config: EngineConfig) -> DecoderModel:
        return shard_model(loaded, config, self.plan, self.group)

    def init_kv(self, plan: KVPlan, tables: BlockTables, heavy_hitters: HeavyHitters) -> None:
        """Tells the workers the block count (they allocate their heads of the same pools), then
        gathers every rank's memory for the start-up report. Hybrid models are not sharded."""
        self.channel = StepChannel(self.group, self.model.device, self.model.dtype, self.model.config.head_dim)
        self.channel.send(Message(Header(Op.SETUP, arg=plan.num_blocks)))
        self.runner = build_runner(self.model, self.config, plan.num_blocks, tables,
                                   cache_type=partial(CopyBroadcastingKVCache, self.channel),
                                   runner_type=partial(TensorParallelRunner, self.channel), heavy_hitters=heavy_hitters)
        self.rank_memory = memory_report(self.group, self.model, self.runner.cache)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._in_step = True  # stays so if the copy is interrupted (Ctrl-C): see close()
        super().copy_blocks(copies)
        self._in_step = False

    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int] = frozenset()) -> torch.Tensor:
        self._in_step = True
        logits = super().execute(chunks, all_logits)
        self._in_step = False
        return logits

    @property
    def shard_plans(self) -> list[ShardPlan]:
        """Every rank's slice of the model (this rank's plan names the whole model's config)."""
        return [ShardPlan(self.plan.config, rank, self.group.world) for rank in range(self.group.world)]

    def report(self) -> str:
        """Weight and KV bytes of every rank, and what each holds."""
        lines = [f"tensor parallel: {self.group.world} ranks"]
        for plan, (weights, kv) in zip(self.shard_plans, self.rank_memory):
            lines.append(f"  {plan.describe()}: weights {format_bytes(weights)}, KV pools {format_bytes(kv)}")
        return "\n".join(lines)

    def policy_refusal(self, policy: CachePolicy) -> str | None:
        if policy.kind == "h2o":
            return ("kv_policy h2o is not supported with tensor parallelism: heavy-hitter scores sum attention "
                    "over every head, and each rank holds only its own (window and sinks policies work)")
        return None

    def broken(self) -> Exception | None:
        """A broken group (a rank died or hung) ends the engine, with the reason."""
        message = self.group.broken
        return None if message is None else DistributedError(f"tensor parallelism failed: {message}")

    def describe_failure(self, error: Exception) -> str | None:
        if isinstance(error, DistributedError):  # expected, not an internal error: no traceback
            return f"tensor parallelism failed: {error}"
        return None

    def abandon(self) -> None:
        """The engine did not start: the workers are stopped at once and the group left."""
        self._closed = True
        atexit.unregister(self.close)
        if self.workers is not None:
            self.workers.stop(join_seconds=0)
        self.group.destroy()

    def close(self) -> None:
        """Stops every rank: STOP between steps; the workers are terminated if a step was cut short
        (they wait in its collectives) or the group is broken."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        orderly = self.group.broken is None and not self._in_step
        if orderly:
            try:
                self.channel.send(Message(Header(Op.STOP)))
            except DistributedError:
                orderly = False
        if self.workers is not None:
            self.workers.stop(join_seconds=5.0 if orderly else 0.0)
        self.group.destroy()  # so that this process can form another group
