"""The continuous-batching engine over the paged KV cache. Its step reads as one sentence:

    schedule  -> who runs this step (chunks of prompts, decodes, speculative drafts); preempt if short
    run       -> copy-on-write copies and drafts proposed, then the model on the batch, on the executor
                 (this process, or rank 0 of a tensor-parallel group: kvgen.engine.executor)
    postprocess -> prompt logprobs, verify drafts / sample, record tokens, free finished sequences and
                 the blocks a cache policy let go, take back rejected tokens' slots

Requests come in through one admission (kvgen.engine.admission); the KV pools are sized by the KV
plan (kvgen.cache.sizing.plan_kv).
"""

from __future__ import annotations

import logging
import time

import torch

from kvgen.cache.heavy_hitters import HeavyHitters
from kvgen.cache.kv_dtype import resolve_kv_dtype
from kvgen.cache.kv_manager import NULL_BLOCK
from kvgen.cache.sizing import plan_kv
from kvgen.cache.tiers.build import attach_pools, build_tiered_manager
from kvgen.config import EngineConfig
from kvgen.loaders.parameters import describe_parameters
from kvgen.engine.admission import Admission, KVLimits
from kvgen.engine.base import Engine, EngineStats, finite_rows
from kvgen.engine.executor import Executor
from kvgen.engine.recurrent import RecurrentSteps, build_state_pool, describe, draft_refusal, policy_refusal
from kvgen.engine.recurrent import recurrent_refusal
from kvgen.engine.speculative.speculator import Speculator, build_speculator
from kvgen.engine.step_log import StepLog, split_tokens
from kvgen.loaders import LoadedModel
from kvgen.sample.rejection import Verdict
from kvgen.sample.sampler import SamplerOutput, logprobs_of
from kvgen.scheduling.output import SchedulerOutput
from kvgen.scheduling.scheduler import Scheduler, SchedulerConfig
from kvgen.scheduling.sequence import Request, RequestOutput, Sequence
from kvgen.scheduling.state_slots import StateSlots

log = logging.getLogger(__name__)


class LLMEngine(Engine):
    """Many requests at once: one forward pass per step over every scheduled sequence."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None,
                 executor: Executor | None = None) -> None:
        """`draft`: the draft model of speculative_method 'draft' (loaded by kvgen.llm.build_engine);
        `executor`: where the model runs (this process unless given: kvgen.distributed builds rank 0's).
        An "auto" KV dtype becomes the model's default here (kvgen.cache.kv_dtype: 16-bit on packed weights)."""
        config = resolve_kv_dtype(loaded, config)
        refusal = recurrent_refusal(loaded.config, config) or (draft_refusal(draft.config) if draft else None)
        if refusal is not None:
            raise ValueError(refusal)
        super().__init__(loaded, config)
        self.executor = executor or Executor(loaded, config)
        self.model = self.executor.model
        self.kv_plan = plan_kv(loaded.config, config, self.max_model_len)
        if config.kv_tiers:  # host / disk tiers below the pool (kvgen.cache.tiers)
            self.kv = build_tiered_manager(config, self.kv_plan, loaded.config,
                                           {**loaded.weights, **loaded.quantized}, config.dtype)
        else:
            self.kv = self.kv_plan.manager(config.enable_prefix_caching, config.max_num_batched_tokens)
        self.heavy_hitters = HeavyHitters(self.model.device, config.block_size)
        self.executor.init_kv(self.kv_plan, self.kv, self.heavy_hitters)
        self.runner = self.executor.runner
        if config.kv_tiers:
            attach_pools(self.kv, [kind.cache for kind in self.runner.kinds], config.kv_offload_dtype)
        self.speculator: Speculator | None = build_speculator(config, loaded.config, self.kv, draft, self.runner)
        state_slots, self.recurrent = self._state_pool(loaded, config)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv,
                                   self.speculator.lookahead if self.speculator is not None else None, state_slots)
        self.admission = Admission(self.tokenizer, loaded.config, self.max_model_len,
                                   KVLimits(self.kv, self.capacity_tokens, config.max_num_batched_tokens,
                                            state_slots.pool.num_slots if state_slots else None),
                                   speculative=self.speculator is not None,
                                   policy_refusal=lambda policy: (policy_refusal(loaded.config, policy.kind)
                                                                  or self.executor.policy_refusal(policy)),
                                   grammars=self.grammars)
        self.step_log = StepLog()
        log.info("%s", self.capacity_report())

    def _state_pool(self, loaded: LoadedModel, config: EngineConfig
                    ) -> tuple[StateSlots | None, RecurrentSteps | None]:
        """A recurrent model's state pool beside the KV pools (kvgen.engine.recurrent), given to the runner."""
        if not loaded.config.recurrent_layers:
            return None, None
        pool = build_state_pool(loaded.config, config)
        self.runner.state_pool = pool
        slots = StateSlots(pool, config.block_size, config.enable_prefix_caching)
        return slots, RecurrentSteps(pool, slots)

    def __getattr__(self, name: str) -> object:
        """What the engine lacks, its executor may have (a tensor-parallel group's `workers`, `shard_plans`)."""
        executor = self.__dict__.get("executor")
        if executor is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(executor, name)

    def close(self) -> None:
        self.executor.close()

    @property
    def bytes_per_token(self) -> int:
        return self.kv_plan.bytes_per_token

    @property
    def layer_kinds(self) -> list:
        """A hybrid model's kinds of layers, the global kind first (kvgen.cache.hybrid); else []."""
        return list(self.kv_plan.kinds)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pools hold: of a hybrid model, those of its global layers' pool."""
        return self.kv_plan.capacity_tokens

    def capacity_report(self) -> str:
        report = self.kv_plan.report()
        if self.recurrent is not None:
            report = f"{report}; {describe(self.recurrent.pool)}"
        extra = self.speculator.capacity_report() if self.speculator is not None else None
        report = report if extra is None else f"{report}; {extra}"
        where = self.executor.report()
        report = report if where is None else f"{report}\n{where}"
        return f"{report}\n{describe_parameters(self.model_config)}" if self.model_config.is_moe else report

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            kv_blocks_cached_free=self.kv.num_cached_free_blocks, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            kv_tiers=self.kv.tiers.readings() if self.config.kv_tiers else (), **self._spec_stats(),
            **(self.recurrent.stats() if self.recurrent is not None else {}),
            expert_tokens=self.runner.model.expert_tokens(),
        )

    def pin_prefix(self, token_ids: list[int], pin: bool = True) -> dict[str, int]:
        """Keeps (pin) or lets go (unpin) a prompt's computed blocks in the KV tiers (kvgen.cache.tiers)."""
        if not self.config.kv_tiers:
            raise ValueError("pinning needs KV tiers: start with --kv-offload-memory or --kv-cache-dir")
        return self.kv.pin(token_ids, None, pin)

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_proposed": c.proposed, "spec_accepted": c.accepted, "spec_verify_steps": c.verify_steps}

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. An executor that can run no more steps (a broken
        tensor-parallel group) ends the engine, before the step or after it."""
        self._stop_if_broken()
        started = time.perf_counter()
        schedule = self._schedule()
        outputs = self._run_step(schedule, started) if schedule.chunks else []
        self._stop_if_broken()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """Who runs this step, and whether it speculates; preempted sequences drop their state."""
        if self.speculator is not None:
            self.speculator.begin_step(len(self.scheduler.running), prompts_waiting=bool(self.scheduler.waiting))
        schedule = self.scheduler.schedule()
        for seq in schedule.preempted:
            self._forget(seq.seq_id)
        return schedule

    def _run_step(self, schedule: SchedulerOutput, started: float) -> list[RequestOutput]:
        """propose -> run -> postprocess over a schedule with chunks, then the step's log line."""
        tokens, released = split_tokens(schedule.chunks), []
        try:
            tokens = self._propose(schedule)
            logits = self._run(schedule)
            outputs = self._postprocess(schedule, logits, released)
            if self.speculator is not None:
                self.speculator.observe(schedule.chunks)
        except Exception as error:  # noqa: BLE001 - a fault fails the step's requests, not the engine
            if self.recurrent is not None:
                self.recurrent.abandon(schedule.chunks)
            outputs = self.fail({chunk.seq.request for chunk in schedule.chunks}, self._failure_message(error))
        self._log_step(schedule, tokens, outputs, released, time.perf_counter() - started)
        return outputs

    def _log_step(self, schedule: SchedulerOutput, tokens: tuple[int, int], outputs: list[RequestOutput],
                  released: list[int], seconds: float) -> None:
        self.step_log.add(tokens, len(schedule.chunks), len(schedule.preempted), seconds, released)
        if self.speculator is not None:
            emitted = sum(len(c.new_token_ids) for out in outputs for c in out.outputs)
            self.speculator.end_step(tokens[0] == 0, emitted, seconds)

    def _failure_message(self, error: Exception) -> str:
        """Called while `error` is handled: an expected failure of the executor as it describes it, else
        an internal error, logged with its traceback."""
        message = self.executor.describe_failure(error)
        if message is None:
            log.exception("engine step failed")
            message = f"internal error: {error!r}"
        return message

    def _stop_if_broken(self) -> None:
        """An executor that can run no more steps ends the engine: every request fails with the reason,
        the executor closes, `on_failure` hears it, and the error is raised (at every later step too)."""
        error = self.executor.broken()
        if error is None:
            return
        self.failure = str(error)
        self.fail(list(self.requests.values()), self.failure)
        self.close()
        self.on_failure(self.failure)
        raise error

    def _propose(self, schedule: SchedulerOutput) -> tuple[int, int]:
        """Applies pending copy-on-write copies (to the draft's pools too), fills the drafts; returns
        the step's (prefill, decode) tokens, read before the step advances the sequences."""
        copies = self.kv.take_pending_copies()
        self.executor.copy_blocks(copies)
        if self.speculator is not None:  # the draft's pools follow the global layers' block ids
            self.speculator.copy_blocks(copies[0] if self.kv_plan.kinds else copies)
            self.speculator.propose(schedule.chunks)
        if self.recurrent is not None:
            self.recurrent.begin_step(schedule.chunks)
        return split_tokens(schedule.chunks)

    def _run(self, schedule: SchedulerOutput) -> torch.Tensor:
        """The forward pass on the executor: every row of a prompt chunk whose log-probabilities are
        scored and of a speculative chunk, one row per other chunk that completes its sequence."""
        verifying = {chunk.seq.seq_id for chunk in schedule.chunks if chunk.draft}
        return self.executor.execute(schedule.chunks, self._scoring_prompts(schedule) | verifying)

    def _postprocess(self, schedule: SchedulerOutput, logits: torch.Tensor, released: list[int]) -> list[RequestOutput]:
        """Records prompt log-probabilities, verifies drafts, advances every sequence (freeing the
        blocks its policy let go into `released`), samples and records the new tokens."""
        logits = self._record_prompt_logprobs(schedule, self._scoring_prompts(schedule), logits)
        logits, verdicts = self._verify(schedule, logits)
        sampling = [chunk.seq for chunk in schedule.chunks if chunk.completes_sequence and not chunk.draft]
        self._mark_computed(schedule, released, verdicts)
        rows, logits = self._sampling_rows(sampling, logits)
        verified_rows = [seq for seq, v in verdicts.values() if v is not None for _ in v.token_ids]
        verified = SamplerOutput([t for _, v in verdicts.values() if v is not None for t in v.token_ids],
                                 [lp for _, v in verdicts.values() if v is not None for lp in v.logprobs])
        broken = [seq.request for seq, v in verdicts.values() if v is None]
        return self.sample_and_record(rows, logits, verified, verified_rows, broken)

    def _verify(self, schedule: SchedulerOutput, logits: torch.Tensor
                ) -> tuple[torch.Tensor, dict[int, tuple[Sequence, Verdict | None]]]:
        """Splits the rows: 1 + k of each speculative chunk are verified (None where not finite), the
        one row of every other completing chunk is returned for sampling."""
        verdicts: dict[int, tuple[Sequence, Verdict | None]] = {}
        if self.speculator is None or not any(chunk.draft for chunk in schedule.chunks):
            return logits, verdicts
        keep, row = [], 0
        for chunk in schedule.chunks:
            if chunk.draft:
                rows = logits[row : row + chunk.num_tokens]  # [1 + k, vocab]
                finite = bool(finite_rows(rows).all())
                verdicts[chunk.seq.seq_id] = (chunk.seq, self.speculator.verify(chunk, rows) if finite else None)
                row += chunk.num_tokens
            elif chunk.completes_sequence:
                keep.append(row)
                row += 1
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], verdicts

    def _mark_computed(self, schedule: SchedulerOutput, released: list[int],
                       verdicts: dict[int, tuple[Sequence, Verdict | None]]) -> None:
        """Advances each sequence (a speculative one by its verified tokens only, giving the rejected
        ones' slots back), offers its new full blocks to the prefix cache, drops dead ones (appending
        their block ids to `released`)."""
        now = time.monotonic()
        for chunk in schedule.chunks:
            seq = chunk.seq
            verdict = verdicts.get(seq.seq_id, (seq, None))[1]
            accepted = chunk.draft[: verdict.num_accepted] if verdict is not None else []
            seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft) + len(accepted)
            if chunk.num_lookahead:
                self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
                self.speculator.rollback(seq)
            if self.recurrent is not None:
                self.recurrent.end_chunk(chunk, len(accepted))
            if seq.policy.shares_prefixes:  # verified tokens only: the accepted drafts are not appended yet
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids + accepted if accepted else seq.token_ids,
                                          seq.num_computed_tokens, extra_key=seq.policy.prefix_key)
            dead = self._dead_blocks(seq)
            released.extend(b for i in dead if (b := self.kv.block_id(seq.seq_id, i)) != NULL_BLOCK)
            self.kv.release_blocks(seq.seq_id, dead)
            self.kv.slide(seq.seq_id, seq.num_computed_tokens)
            if seq.request.metrics.first_scheduled is None:
                seq.request.metrics.first_scheduled = now

    def _dead_blocks(self, seq: Sequence) -> range | list[int]:
        """Blocks that no later query of `seq` reads under its cache policy and that it still holds."""
        if seq.policy.kind == "h2o":
            return self.heavy_hitters.evict(seq.seq_id, seq.num_computed_tokens, seq.policy)
        start, end = seq.policy.dead_range(seq.num_computed_tokens)
        first = max(-(-start // self.kv.block_size), seq.num_dead_blocks)
        seq.num_dead_blocks = max(first, end // self.kv.block_size)
        return range(first, seq.num_dead_blocks)

    def _scoring_prompts(self, schedule: SchedulerOutput) -> set[int]:
        """Sequences that want a log-probability for every prompt token they compute this step."""
        return {c.seq.seq_id for c in schedule.chunks
                if c.seq.params.prompt_logprobs is not None and c.start < len(c.seq.prompt_token_ids)}

    def _record_prompt_logprobs(self, schedule: SchedulerOutput, scoring: set[int],
                                logits: torch.Tensor) -> torch.Tensor:
        """Takes the prompt rows out of `logits` (recording each next prompt token's log-probability)
        and returns one row per chunk that completes its sequence (1 + k per speculative one)."""
        if not scoring:
            return logits
        keep, row = [], 0
        for chunk in schedule.chunks:
            if chunk.seq.seq_id not in scoring:  # a speculative chunk keeps its 1 + k rows for verifying
                num_rows = chunk.num_tokens if chunk.draft else int(chunk.completes_sequence)
                keep.extend(range(row, row + num_rows))
                row += num_rows
                continue
            seq, recorded = chunk.seq, chunk.seq.request.prompt_logprobs
            targets = seq.prompt_token_ids[chunk.start + 1 : chunk.start + chunk.num_tokens + 1]
            new = len(recorded) - 1 - chunk.start  # a recomputed (preempted) prompt is not scored twice
            if new < len(targets):
                rows = logits[row + max(new, 0) : row + len(targets)]
                recorded.extend(logprobs_of(rows, targets[max(new, 0):], seq.params.prompt_logprobs))
            row += chunk.num_tokens
            keep.extend([row - 1] if chunk.completes_sequence else [])
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _sampling_rows(self, sampling: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences to sample for, one logits row each; an n > 1 request forks its completions
        off the first once the prompt is computed, and they sample from the same logits."""
        rows: list[Sequence] = []
        row_index: list[int] = []
        for i, seq in enumerate(sampling):
            family = [seq] + (self._fork_completions(seq) if self._is_first_token(seq) else [])
            rows.extend(family)
            row_index.extend([i] * len(family))
        if len(row_index) != logits.shape[0]:
            logits = logits[torch.tensor(row_index, device=logits.device, dtype=torch.long)]
        return rows, logits

    @staticmethod
    def _is_first_token(seq: Sequence) -> bool:
        return seq.index == 0 and not seq.output_token_ids and seq.request.params.n > 1

    def _fork_completions(self, parent: Sequence) -> list[Sequence]:
        """Completions 1..n-1 share every prompt block of completion 0 (copy-on-write)."""
        children = parent.request.sequences[1:]
        for child in children:
            if child.status.value != "waiting" or child.is_finished:
                continue
            self.kv.fork(parent.seq_id, child.seq_id)
            if self.recurrent is not None:
                self.recurrent.slots.fork(parent, child)
            self.heavy_hitters.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_running(child)
        return [c for c in children if not c.is_finished]

    def _enqueue(self, request: Request) -> None:
        self.scheduler.add(request.sequences[0])

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._forget(seq.seq_id)

    def _forget(self, seq_id: int) -> None:
        """Drops the tensor state of a sequence that gave its blocks back (finished or preempted)."""
        self.heavy_hitters.forget(seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq_id)
