"""Rank 0's engine under tensor parallelism: the continuous-batching engine, unchanged in what it
schedules and how it pages, with each step's tensors sent to the workers before its own forward.

The scheduler, the KV manager and every block table live on rank 0 only; the workers hold their
heads of the same blocks. So paging, prefix caching, copy-on-write (`CopyBroadcastingKVCache` sends
the copies), bounded policies and preemption work as with one process. Heavy hitters (h2o) are
refused: their scores sum attention weights over every head, and no rank holds every head.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from functools import partial

import torch

from kvgen.cache.policies import CachePolicy
from kvgen.cache.sizing import format_bytes
from kvgen.config import EngineConfig
from kvgen.distributed.group import DistributedError, TensorParallelGroup
from kvgen.distributed.liveness import WorkerWatch
from kvgen.distributed.messages import (
    Header,
    Message,
    Op,
    StepChannel,
    encode_copies,
    encode_step,
)
from kvgen.distributed.shard import ShardPlan
from kvgen.distributed.worker import memory_report, shard_model
from kvgen.engine.llm_engine import LLMEngine, build_runner
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvgen.engine.sequence import RequestOutput
from kvgen.errors import InvalidRequestError
from kvgen.loaders import LoadedModel
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.decoder import DecoderModel
from kvgen.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


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


class TensorParallelEngine(LLMEngine):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, group: TensorParallelGroup,
                 workers: WorkerWatch | None = None) -> None:
        if loaded.shard is None:
            raise ValueError("a tensor-parallel engine needs the model loaded with its shard plan")
        self.group, self.plan, self.workers = group, loaded.shard, workers
        self._closed, self._between_steps = False, True
        # Called with the reason once the group broke and every request failed (`kvgen serve` stops).
        self.on_failure: Callable[[str], None] = lambda _: None
        self.failure: str | None = None
        super().__init__(loaded, config)  # logs capacity_report(), every rank's memory with it
        atexit.register(self.close)

    def _build_model(self, loaded: LoadedModel, config: EngineConfig) -> DecoderModel:
        return shard_model(loaded, config, self.plan, self.group)

    def _build_runner(self, num_blocks: int) -> ModelRunner:
        self.channel = StepChannel(self.group, self.model.device, self.model.dtype, self.model.config.head_dim)
        self.channel.send(Message(Header(Op.SETUP, arg=num_blocks)))
        runner = build_runner(self.model, self.config, num_blocks, self.kv,
                              cache_type=partial(CopyBroadcastingKVCache, self.channel),
                              runner_type=partial(TensorParallelRunner, self.channel))
        self.rank_memory = memory_report(self.group, self.model, runner.cache)
        return runner

    @property
    def shard_plans(self) -> list[ShardPlan]:
        return [ShardPlan(self.model_config, rank, self.group.world) for rank in range(self.group.world)]

    def memory_report(self) -> str:
        """Weight and KV bytes of every rank, and what each holds."""
        lines = [f"tensor parallel: {self.group.world} ranks"]
        for plan, (weights, kv) in zip(self.shard_plans, self.rank_memory):
            lines.append(f"  {plan.describe()}: weights {format_bytes(weights)}, KV pools {format_bytes(kv)}")
        return "\n".join(lines)

    def capacity_report(self) -> str:
        return super().capacity_report() + "\n" + self.memory_report()

    def resolve_policy(self, params: SamplingParams) -> CachePolicy:
        policy = super().resolve_policy(params)
        if policy.kind == "h2o":
            raise InvalidRequestError("kv_policy h2o is not supported with tensor parallelism: heavy-hitter "
                                      "scores sum attention over every head, and each rank holds only its own "
                                      "(window and sinks policies work)")
        return policy

    def step(self) -> list[RequestOutput]:
        self._stop_if_broken()
        self._between_steps = False  # stays so if the step is interrupted (Ctrl-C): see close()
        outputs = super().step()
        self._between_steps = True
        self._stop_if_broken()
        return outputs

    def _run(self, schedule: SchedulerOutput, released: list[int]) -> list[RequestOutput]:
        try:
            return super()._run(schedule, released)
        except DistributedError as error:  # expected, not an internal error: no traceback
            return self.fail({chunk.seq.request for chunk in schedule.chunks}, f"tensor parallelism failed: {error}")

    def _stop_if_broken(self) -> None:
        """A broken group ends the engine: every request fails with the reason, the workers stop."""
        message = self.group.broken
        if message is None:
            return
        self.failure = f"tensor parallelism failed: {message}"
        self.fail(list(self.requests.values()), self.failure)
        self.close()
        self.on_failure(self.failure)
        raise DistributedError(self.failure)

    def close(self) -> None:
        """Stops every rank: STOP between steps; the workers are terminated if a step was cut short
        (they wait in its collectives) or the group is broken."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        orderly = self.group.broken is None and self._between_steps
        if orderly:
            try:
                self.channel.send(Message(Header(Op.STOP)))
            except DistributedError:
                orderly = False
        if self.workers is not None:
            self.workers.stop(join_seconds=5.0 if orderly else 0.0)
        self.group.destroy()  # so that this process can form another group
