"""The engine's side of speculative decoding: who speculates, how many slots, proposing, verifying.

    schedule   the scheduler asks `lookahead(seq)` for every running decode: K' <= K slots past its end
    propose    `propose(chunks)` fills each such chunk's draft (the chunk shrinks to 1 + len(draft))
    run        the target scores the chunk's 1 + k tokens in one pass, k + 1 rows of logits
    verify     `verify(chunk, logits)` keeps the longest right prefix and one more token
    rollback   the engine takes back the rejected tokens' slots; `rollback(seq)` tells the proposer
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvgen.cache.kv_manager import KVCacheManager
from kvgen.config import EngineConfig, ModelConfig
from kvgen.engine.speculative.adaptive import AdaptiveSwitch
from kvgen.engine.speculative.draft import DraftProposer
from kvgen.engine.speculative.hybrid import SuffixFirst
from kvgen.engine.speculative.mtp import MTPProposer
from kvgen.engine.speculative.ngram import NgramProposer
from kvgen.engine.speculative.proposer import Proposer
from kvgen.engine.speculative.suffix import SuffixProposer
from kvgen.loaders import LoadedModel
from kvgen.model.fused import FUSED_BELOW_ROWS
from kvgen.runner.model_runner import ModelRunner
from kvgen.sample.rejection import Verdict, verify
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence

log = logging.getLogger(__name__)

# A verify chunk of K + 1 rows runs a decode's kernels (the few-row matmuls, the fused step, the
# in-place attention) below FUSED_BELOW_ROWS rows. From there a step takes the prefill kernels
# (weights dequantized for a GEMM, oneDNN), whose sums differ from decode's, and a greedy token could
# then differ from plain decoding's (K = 15 on SmolLM2 Q4_1 verified 16 rows on its weights dequantized
# to bf16). So a sequence verifies at most this many tokens a step, whatever K asks.
MAX_EXACT_TOKENS = FUSED_BELOW_ROWS - 2

# Plain steps of at most this many sequences ask the proposer for its guesses (the switch's guess
# streaks, which need every sequence's token guessed: rare in a big batch, where the lookups, ~0.1-0.2 ms
# a sequence in Python, would add up to a few percent of a small model's step).
GUESS_MAX_BATCH = 4

# Sinks rotate keys by their rank in the cache and evict one token at a time; h2o scores every
# token's attention. Tokens that are then rejected would have moved ranks or added scores, so
# neither composes with speculation. A window composes: rejected tokens are simply never kept.
UNSPECULATED_POLICIES = ("sinks", "h2o")


@dataclass
class SpecCounters:
    """Totals since the engine started (for /metrics, the bench report)."""

    proposed: int = 0  # draft tokens scored by the target
    accepted: int = 0  # of which kept
    verify_steps: int = 0  # sequence-steps that verified a draft (each emits accepted + 1 tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying sequence-step, the corrected or bonus token included."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"proposed": self.proposed, "accepted": self.accepted, "verify_steps": self.verify_steps,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}


class Speculator:
    """One engine's speculative decoding: its proposer, K, the adaptive switch and the counters."""

    def __init__(self, proposer: Proposer, num_tokens: int, adaptive: bool) -> None:
        self.proposer = proposer
        self.k = num_tokens
        self.switch = AdaptiveSwitch() if adaptive else None
        self.counters = SpecCounters()
        self.active = True  # this step speculates (the adaptive switch's choice)
        self._batch_size = 0
        self._probs: dict[int, torch.Tensor | None] = {}  # seq_id -> q of its draft this step
        self._guesses: dict[int, int | None] = {}  # seq_id -> the proposer's guess of its token this plain step

    # -- scheduling -----------------------------------------------------------------------------

    def begin_step(self, batch_size: int, prompts_waiting: bool = False) -> None:
        """Whether this step speculates. Under the adaptive switch, not while prompts wait to be
        admitted: their prefill is compute-bound work that the K + 1 rows per sequence would delay."""
        self._batch_size = batch_size
        self.active = batch_size > 0 and (
            self.switch is None or (not prompts_waiting and self.switch.decide(batch_size)))

    def lookahead(self, seq: Sequence) -> int:
        """Slots to reserve past `seq`'s last token this step (0: it decodes plainly). The first token
        is always sampled plainly, after the whole prompt (an n > 1 request forks there), even when
        chunked prefill leaves the last prompt token alone in a step."""
        if not seq.output_token_ids or not self.eligible(seq):
            return 0
        if not self.active:
            if self.switch is not None and self._batch_size <= GUESS_MAX_BATCH:
                self._guesses[seq.seq_id] = self.proposer.guess(seq)
            return 0
        remaining = seq.params.max_tokens - len(seq.output_token_ids) - 1  # the bonus token is the last
        k = min(self.k, remaining)
        return self.proposer.reserve(seq, k) if k > 0 else 0

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Grammar-constrained requests are not speculated: the matcher would have to roll back too."""
        return (seq.params.speculative is not False and seq.grammar is None
                and seq.policy.kind not in UNSPECULATED_POLICIES)

    # -- the step -------------------------------------------------------------------------------

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Fills the draft of every chunk that reserved slots; its num_tokens becomes 1 + len(draft).
        Prompt chunks of sequences that will speculate are shown to the proposer as well."""
        prompts = [c for c in chunks if not c.num_lookahead and self.eligible(c.seq)
                   and (c.num_tokens > 1 or c.start < len(c.seq.prompt_token_ids))]
        if prompts:
            self.proposer.prefill(prompts)
        reserved = [c for c in chunks if c.num_lookahead]
        self._probs = {}
        if not reserved:
            return
        for chunk, proposal in zip(reserved, self.proposer.propose(reserved), strict=True):
            chunk.draft = proposal.token_ids[: chunk.num_lookahead]
            chunk.num_tokens = 1 + len(chunk.draft)
            self._probs[chunk.seq.seq_id] = proposal.probs

    def verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> Verdict:
        """logits [1 + k, vocab] of the chunk's rows -> the tokens to append."""
        verdict = verify(logits, chunk.draft, self._probs.get(chunk.seq.seq_id), chunk.seq)
        self.counters.proposed += len(chunk.draft)
        self.counters.accepted += verdict.num_accepted
        self.counters.verify_steps += 1
        metrics = chunk.seq.request.metrics
        metrics.spec_proposed += len(chunk.draft)
        metrics.spec_accepted += verdict.num_accepted
        metrics.spec_verify_steps += 1
        return verdict

    def end_step(self, decode_only: bool, tokens: int, seconds: float) -> None:
        """Feeds the adaptive switch with a step's yield (decode-only steps: prefill would skew it), and
        tells it when a request starts alone (a prefill step at batch 1)."""
        if self.switch is not None and decode_only:
            self.switch.record(self._batch_size, self.active, tokens, seconds)
        elif self.switch is not None and self._batch_size == 1:
            self.switch.new_request()

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """After the step: the chunks of sequences that may speculate, shown to the proposer; on a
        plain step, whether the proposer had guessed every decoded token (the switch's guess streak)."""
        self.proposer.observe([c for c in chunks if self.eligible(c.seq)])
        guesses, self._guesses = self._guesses, {}
        if self.switch is not None and guesses and not self.active:
            emitted = {c.seq.seq_id: c.seq.output_token_ids[-1] for c in chunks if c.seq.output_token_ids}
            hit = all(guess is not None and emitted.get(seq_id) == guess for seq_id, guess in guesses.items())
            self.switch.guess_checked(self._batch_size, hit)

    def rollback(self, seq: Sequence) -> None:
        self.proposer.rollback(seq)

    def forget(self, seq_id: int) -> None:
        self.proposer.forget(seq_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.proposer.copy_blocks(copies)

    def capacity_report(self) -> str | None:
        return self.proposer.capacity_report()


def build_speculator(config: EngineConfig, target: ModelConfig, kv: KVCacheManager,
                     draft: LoadedModel | None, target_runner: ModelRunner) -> Speculator | None:
    """The engine's speculator under `config` (None without speculative_method); `draft` is the
    loaded draft model of method 'draft'; method 'mtp' runs the MTP layer of the target's checkpoint
    (`target_runner.model.mtp`) on the target's hidden states."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.speculative_method == "suffix":
        proposer = SuffixProposer()
    elif config.speculative_method == "mtp":
        proposer = MTPProposer(target_runner, target_runner.model.mtp, config, kv)
    elif draft is None:
        raise ValueError("speculative_method 'draft' needs its draft model loaded (kvgen.llm.build_engine does)")
    else:
        proposer = DraftProposer(draft, target, config, kv)
        if config.draft_suffix_match:
            proposer = SuffixFirst(proposer, config.draft_suffix_match)
    k = config.num_speculative_tokens
    if k > MAX_EXACT_TOKENS:
        log.warning("num_speculative_tokens %d: a sequence verifies at most %d tokens a step (%d rows; from %d "
                    "rows the prefill kernels run, whose sums differ from decoding's)", k, MAX_EXACT_TOKENS,
                    MAX_EXACT_TOKENS + 1, FUSED_BELOW_ROWS)
    return Speculator(proposer, min(k, MAX_EXACT_TOKENS), config.adaptive_speculation)
