"""The continuous-batching engine over the paged KV cache.

    step = schedule -> propose (speculative decoding) -> run the model on the batch
           -> verify / sample -> record tokens, free finished -> take back rejected tokens' slots
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvgen.cache.hybrid import HybridKVManager, LayerKind, layer_kinds, sequence_bytes, split_budget
from kvgen.cache.kv_manager import NULL_BLOCK, KVCacheManager
from kvgen.cache.sizing import format_bytes, kv_bytes_per_token_of, num_blocks_for_budget
from kvgen.config import DEFAULT_KV_MEMORY, EngineConfig
from kvgen.engine.base import Engine, EngineStats, finite_rows
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvgen.engine.sequence import Request, RequestOutput, Sequence
from kvgen.engine.spec.speculator import Speculator, build_speculator
from kvgen.engine.step_log import StepLog, split_tokens
from kvgen.errors import InvalidRequestError
from kvgen.loaders import LoadedModel
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.kernels.paged_decode import paged_decode_for
from kvgen.model.kv_quant import STORAGE_DTYPES
from kvgen.model.decoder import DecoderModel
from kvgen.rejection_sampler import Verdict
from kvgen.runner.model_runner import BlockTables, KVKind, ModelRunner
from kvgen.sampler import SamplerOutput, logprobs_of

log = logging.getLogger(__name__)


class LLMEngine(Engine):
    """Many requests at once: one forward pass per step over every scheduled sequence."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None) -> None:
        """`draft`: the draft model of speculative_method 'draft' (loaded by kvgen.llm.build_engine)."""
        super().__init__(loaded, config)
        num_blocks = self._build_kv_manager()
        self.runner = self._build_runner(num_blocks)
        self.speculator: Speculator | None = build_speculator(config, loaded.config, self.kv, draft)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv,
                                   self.speculator.lookahead if self.speculator is not None else None)
        self.step_log = StepLog()
        log.info("%s", self.capacity_report())

    def _build_kv_manager(self) -> int:
        """Sizes the pools and sets `self.kv` (block bookkeeping only, no tensors); returns the blocks of
        the global pool. The data-parallel front end sizes its admission view by it (kvgen.replicas)."""
        cfg, config = self.model_config, self.config
        self.bytes_per_token = kv_bytes_per_token_of(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.kv_dtype)
        self.layer_kinds = layer_kinds([cfg.window(i) for i in range(cfg.num_layers)]) if cfg.is_hybrid else []
        if self.layer_kinds:
            self.kind_blocks = self._kind_blocks()
            self.kv = HybridKVManager([KVCacheManager(n, config.block_size, config.enable_prefix_caching)
                                       for n in self.kind_blocks], self.layer_kinds, config.max_num_batched_tokens)
            return self.kind_blocks[0]
        num_blocks = self._num_blocks()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        return num_blocks

    def _build_runner(self, num_blocks: int) -> ModelRunner:
        if not self.layer_kinds:
            return build_runner(self.model, self.config, num_blocks, self.kv)
        return build_hybrid_runner(self.model, self.config, self.layer_kinds, self.kind_blocks, self.kv.kinds)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pools hold: of a hybrid model, those of its global layers' pool."""
        return (self.kind_blocks[0] if self.layer_kinds else self.kv.num_blocks) * self.kv.block_size

    def capacity_report(self) -> str:
        report = (f"KV cache: {self.kv.num_blocks} blocks x {self.kv.block_size} tokens = {self.capacity_tokens} "
                  f"tokens, {format_bytes(self.capacity_tokens * self.bytes_per_token)} "
                  f"({self.bytes_per_token} bytes/token, {self.config.kv_dtype})")
        if self.layer_kinds:
            report = "hybrid KV cache: " + "; ".join(self._kind_report(kind, n)
                                                     for kind, n in zip(self.layer_kinds, self.kind_blocks))
        extra = self.speculator.capacity_report() if self.speculator is not None else None
        return report if extra is None else f"{report}; {extra}"

    def _kind_report(self, kind: LayerKind, num_blocks: int) -> str:
        cfg = self.model_config
        per_token = kv_bytes_per_token_of(len(kind.layers), cfg.num_kv_heads, cfg.head_dim, self.config.kv_dtype)
        tokens = num_blocks * self.kv.block_size
        what = "global" if kind.window is None else f"window {kind.window}"
        return (f"{len(kind.layers)} {what} layers, {num_blocks} blocks x {self.kv.block_size} = {tokens} tokens, "
                f"{format_bytes(tokens * per_token)} ({per_token} bytes/token, {self.config.kv_dtype})")

    def _kind_blocks(self) -> list[int]:
        """Blocks per kind of a hybrid model: `num_kv_blocks` each, or the budget split in proportion
        to what a full-length sequence holds in each kind (kvgen.cache.hybrid.split_budget)."""
        cfg, model = self.config, self.model_config
        if cfg.num_kv_blocks is not None:
            return [cfg.num_kv_blocks] * len(self.layer_kinds)
        per_layer = kv_bytes_per_token_of(1, model.num_kv_heads, model.head_dim, cfg.kv_dtype)
        needs = sequence_bytes(self.layer_kinds, per_layer, self.max_model_len, cfg.max_num_batched_tokens,
                               cfg.block_size)
        wanted = cfg.max_num_seqs * sum(needs)
        budget = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else min(wanted, DEFAULT_KV_MEMORY)
        shares = split_budget(budget, needs)
        blocks = [num_blocks_for_budget(share, cfg.block_size, per_layer * len(k.layers))
                  for share, k in zip(shares, self.layer_kinds)]
        if min(blocks) < 1:
            raise ValueError(f"the KV budget holds no block of {cfg.block_size} tokens in every kind of layer")
        return blocks

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            wanted = cfg.max_num_seqs * self.max_model_len * self.bytes_per_token
            budget = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else min(wanted, DEFAULT_KV_MEMORY)
            num_blocks = num_blocks_for_budget(budget, cfg.block_size, self.bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {cfg.block_size} tokens "
                             f"({self.bytes_per_token} bytes per token)")
        return num_blocks

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        super().check_fits(num_prompt_tokens, params)
        total = num_prompt_tokens + params.max_tokens
        peak = self._peak_tokens(total, params)
        if not self.kv.fits(peak):
            need = (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} tokens"
                    if peak == total else f"kv_policy {params.kv_policy} holds up to {peak} tokens at once, which")
            raise InvalidRequestError(f"{need} exceeds the KV cache capacity of {self.capacity_tokens} tokens")

    def check_speculative(self, params: SamplingParams) -> None:
        if self.speculator is None:
            super().check_speculative(params)
        else:
            self.speculator.check_request(params, self.resolve_policy(params))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            kv_blocks_cached_free=self.kv.num_cached_free_blocks, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_proposed": c.proposed, "spec_accepted": c.accepted, "spec_verify_steps": c.verify_steps}

    def _peak_tokens(self, total: int, params: SamplingParams) -> int:
        """Most KV slots one sequence can hold at once: all its tokens, or what its policy keeps plus
        one step's chunk and a block of slack on each side of a gap. Heavy hitters may lie in as
        many blocks as there are of them, each held for the one token."""
        policy = self.resolve_policy(params)
        if policy.max_kept is None:
            return total
        kept = policy.max_kept + policy.heavy * (self.kv.block_size - 1)
        return min(total, kept + self.config.max_num_batched_tokens + 2 * self.kv.block_size)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.begin_step(len(self.scheduler.running), prompts_waiting=bool(self.scheduler.waiting))
        schedule = self.scheduler.schedule()
        for seq in schedule.preempted:
            self._forget(seq.seq_id)
        if not schedule.chunks:
            return []
        tokens, released = split_tokens(schedule.chunks), []
        try:
            tokens = self._propose(schedule)
            outputs = self._run(schedule, released)
        except Exception as error:  # noqa: BLE001 - a fault fails the step's requests, not the engine
            log.exception("engine step failed")
            outputs = self.fail({chunk.seq.request for chunk in schedule.chunks}, f"internal error: {error!r}")
        seconds = time.perf_counter() - started
        self.step_log.add(tokens, len(schedule.chunks), len(schedule.preempted), seconds, released)
        if self.speculator is not None:
            emitted = sum(len(c.new_token_ids) for out in outputs for c in out.outputs)
            self.speculator.end_step(tokens[0] == 0, emitted, seconds)
        return outputs

    def _propose(self, schedule: SchedulerOutput) -> tuple[int, int]:
        """Applies pending copy-on-write copies (to the draft's pools too), fills the drafts; returns
        the step's (prefill, decode) tokens, read before the step advances the sequences."""
        copies = self.kv.take_pending_copies()
        self.runner.copy_blocks(copies)
        if self.speculator is not None:  # the draft's pools follow the global layers' block ids
            self.speculator.copy_blocks(copies[0] if self.layer_kinds else copies)
            self.speculator.propose(schedule.chunks)
        return split_tokens(schedule.chunks)

    def _run(self, schedule: SchedulerOutput, released: list[int]) -> list[RequestOutput]:
        scoring = self._scoring_prompts(schedule)
        verifying = {chunk.seq.seq_id for chunk in schedule.chunks if chunk.draft}
        logits = self.runner.execute(schedule.chunks, scoring | verifying)
        logits = self._record_prompt_logprobs(schedule, scoring, logits)
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
            return self.runner.evict_heavy_hitters(seq.seq_id, seq.num_computed_tokens, seq.policy)
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
            self.runner.fork_state(parent.seq_id, child.seq_id)
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
        self.runner.forget(seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq_id)


def build_hybrid_runner(model: DecoderModel, config: EngineConfig, kinds: list[LayerKind], kind_blocks: list[int],
                        tables: list[KVCacheManager]) -> ModelRunner:
    """The runner over one pool per kind of layer (kvgen.cache.hybrid), the global kind first."""
    cfg = model.config
    pool_dtype = STORAGE_DTYPES[config.kv_dtype]
    caches = [PagedKVCache(len(kind.layers), n, config.block_size, cfg.num_kv_heads, cfg.head_dim, model.device,
                           pool_dtype, compute_dtype=model.dtype) for kind, n in zip(kinds, kind_blocks)]
    decode_kernel = paged_decode_for(config.attention_backend, model.device, model.dtype, pool_dtype)
    more = [KVKind(cache, table, kind.window, list(kind.layers))
            for cache, table, kind in zip(caches[1:], tables[1:], kinds[1:])]
    return ModelRunner(model, caches[0], tables[0], decode_kernel, more)


def build_runner(model: DecoderModel, config: EngineConfig, num_blocks: int, block_tables: BlockTables | None,
                 cache_type: Callable[..., PagedKVCache] = PagedKVCache,
                 runner_type: Callable[..., ModelRunner] = ModelRunner) -> ModelRunner:
    """The runner over KV pools of `num_blocks` blocks for the model's (local) KV heads."""
    cfg = model.config
    pool_dtype = STORAGE_DTYPES[config.kv_dtype]
    cache = cache_type(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                       model.device, pool_dtype, compute_dtype=model.dtype)
    decode_kernel = paged_decode_for(config.attention_backend, model.device, model.dtype, pool_dtype)
    return runner_type(model, cache, block_tables, decode_kernel)
