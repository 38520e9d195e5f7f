"""Where the model runs. The engine schedules, pages and samples in one code path, and hands each
step's forward pass to its executor (as vLLM's engine hands it to its executor):

    Executor                    this process: the model and its runner over the KV pools
    TensorParallelExecutor      rank 0 of a tensor-parallel group (kvgen.distributed.executor): the
                                same runner, each step's tensors sent to the workers before its own
                                shard runs them

What the engine asks of an executor:

    init_kv(plan, tables, heavy_hitters)   allocate the pools the KV plan sized, build the runner
    copy_blocks(copies)                    copy-on-write copies, before the step that needs them
    execute(chunks, all_logits)            the step's forward pass -> logits
    policy_refusal(policy)                 a cache policy this executor cannot run (admission asks)
    broken()                               the error that ended it, once it can run no more steps
    describe_failure(error)                an expected failure of a step, as its requests are told
    close()                                release what it holds beyond memory (worker processes)
"""

from __future__ import annotations

import logging

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.policies import CachePolicy
from kvgen.cache.sizing import KVPlan, format_bytes
from kvgen.config import EngineConfig
from kvgen.loaders import LoadedModel
from kvgen.model.decoder import DecoderModel
from kvgen.runner.model_runner import BlockTables, ModelRunner, build_hybrid_runner, build_runner
from kvgen.scheduling.output import ScheduledChunk

log = logging.getLogger(__name__)


def load_model(loaded: LoadedModel, config: EngineConfig) -> DecoderModel:
    """The model of `loaded` in this process, as `config` keeps its weights."""
    model = DecoderModel(loaded.config, {**loaded.weights, **loaded.quantized}, config.device,
                         config.torch_dtype, config.quantization, config.fused_decode, config.activations)
    model.mtp = loaded.mtp
    return model


def log_weights(model: DecoderModel) -> None:
    log.info("weights: %s", "; ".join(f"{role} {kernel} ({format_bytes(size)})"
                                      for role, (kernel, size) in model.kernels().items()))


class Executor:
    """Runs the model in this process."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.model = self.load_model(loaded, config)
        log_weights(self.model)
        self.runner: ModelRunner | None = None  # once init_kv has allocated the pools

    def load_model(self, loaded: LoadedModel, config: EngineConfig) -> DecoderModel:
        return load_model(loaded, config)

    def init_kv(self, plan: KVPlan, tables: BlockTables, heavy_hitters: HeavyHitters) -> None:
        """Allocates the KV pools of `plan` (one per kind of layer of a hybrid model) for the model's
        KV heads; `tables` are the engine's block tables over them."""
        if plan.kinds:
            self.runner = build_hybrid_runner(self.model, self.config, list(plan.kinds), list(plan.blocks),
                                              tables.kinds, heavy_hitters)
        else:
            self.runner = build_runner(self.model, self.config, plan.num_blocks, tables, heavy_hitters=heavy_hitters)

    def copy_blocks(self, copies: list[tuple[int, int]] | list[list[tuple[int, int]]]) -> None:
        self.runner.copy_blocks(copies)

    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int] = frozenset()) -> torch.Tensor:
        """fp32 logits in the order of `chunks` (kvgen.runner.model_runner.ModelRunner.execute)."""
        return self.runner.execute(chunks, all_logits)

    def policy_refusal(self, policy: CachePolicy) -> str | None:
        """Why this executor cannot run a request under `policy` (None: it can)."""
        return None

    def report(self) -> str | None:
        """What the start-up log adds to the KV report (each rank's memory under tensor parallelism)."""
        return None

    def broken(self) -> Exception | None:
        """The error that ended this executor, once it can run no more steps (never, in this process)."""
        return None

    def describe_failure(self, error: Exception) -> str | None:
        """What the requests of a step that raised `error` are told, when it is an expected failure of
        where the model runs (None: an internal error, which the engine logs with its traceback)."""
        return None

    def close(self) -> None:
        """Releases what the executor holds beyond memory; idempotent."""
