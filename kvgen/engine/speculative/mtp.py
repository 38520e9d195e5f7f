"""The checkpoint's own MTP layer proposes (Qwen3.5's and Qwen3.5-MoE's multi-token prediction;
kvgen.model.mtp).

The head reads the target's hidden states, so it follows the target a step behind. Its one layer
keeps K/V in a pool of its own under the target's block ids (as the draft model's: kvgen.engine.
speculative.draft), written at position i from the target's state at i and the token at i + 1:

    observe     after each target step, the states it computed at verified positions (whose next
                token is known) are kept for the head (FLUSH_ROWS below)
    propose     first the head runs over the kept states in one pass: its K/V there, and h'[N - 2],
                its state at the sequence's last verified position (N tokens, N - 1 uncomputed);
                d_1 = argmax lm_head(h'[N - 2]) guesses token N (the one the verify step's first row
                decides); each further guess chains: the head at position N - 2 + j reads d_j and
                h'[N - 3 + j] -> d_(j+1). Those K/V are rewritten from the target's states by the
                next pass, before anything reads them.

A position the target did not compute (a prefix-cache hit) keeps what the head wrote there for the
sequence that computed it; a sequence whose last state the head has not seen (just forked, or
resumed) proposes nothing for one step. The head's numbers only steer proposals, never the output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvgen.cache.kv_manager import KVCacheManager
from kvgen.cache.sizing import format_bytes, kv_bytes_per_token_of
from kvgen.config import EngineConfig
from kvgen.engine.speculative.draft import DRAFT_ACTIVATIONS, DraftChunk, draft_tokens
from kvgen.engine.speculative.proposer import Proposal, Proposer
from kvgen.model.kernels.paged_decode import paged_decode_for
from kvgen.model.kv_quant import STORAGE_DTYPES
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.linear_choice import LayerBuilder, Weight
from kvgen.model.mtp import MTPHead
from kvgen.runner.model_runner import ModelRunner
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence


# The target's states a sequence holds before the head runs them. The head runs as late as a proposal
# needs it: while the adaptive switch decodes plainly it would cost a layer and a pass a step for
# nothing (on a Qwen3.5-0.8B shape, AVX2, plain decoding at 34 tok/s fell to 27); a prompt's chunks
# are run as they come, since they hold this many rows.
FLUSH_ROWS = 256


@dataclass
class HeadChunk(DraftChunk):
    """A head pass over positions `start`.. : `tokens` the token after each, `hidden` [rows, hidden] the
    state that predicted it (the target's, or the head's own when chaining)."""

    hidden: torch.Tensor | None = None


class MTPProposer(Proposer):
    def __init__(self, target: ModelRunner, weights: Mapping[str, Weight], config: EngineConfig,
                 kv: KVCacheManager) -> None:
        model = target.model
        build = LayerBuilder(model.device, model.dtype, config.quantization, DRAFT_ACTIVATIONS)
        self.head = MTPHead(model, weights, build)
        cfg = self.head.config
        pool_dtype = STORAGE_DTYPES[config.kv_dtype]
        self.cache = PagedKVCache(1, kv.num_blocks, kv.block_size, cfg.num_kv_heads, cfg.head_dim, model.device,
                                  pool_dtype, compute_dtype=model.dtype)
        kernel = paged_decode_for(config.attention_backend, model.device, model.dtype, pool_dtype)
        self.runner = ModelRunner(self.head, self.cache, kv, kernel)
        self.runner.keeps_hidden = True
        self.target = target
        target.keeps_hidden = True
        self.kv = kv
        self.p_min = config.draft_p_min  # as the draft's: stop after a guess the head gives less
        self.bytes_per_token = kv_bytes_per_token_of(1, cfg.num_kv_heads, cfg.head_dim, config.kv_dtype)
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (position i, h'[i] [hidden])
        # seq_id -> (first position, [rows, hidden] tensors): the target's states the head has not run yet
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """Keeps the target's states of these chunks' verified positions (after the step) for the head;
        a sequence holding FLUSH_ROWS of them runs them through it now."""
        full = []
        for chunk in chunks:
            seq, kept = chunk.seq, self.target.kept_hidden.get(chunk.seq.seq_id)
            if kept is None or seq.is_finished:
                continue
            start, rows = kept
            rows = rows[: max(0, min(len(rows), seq.num_computed_tokens - start))]  # verified only
            first, held = self.pending.get(seq.seq_id, (start, []))
            if first + sum(len(r) for r in held) != start:  # not where the held ones end: start over there
                first, held = start, []
            self.pending[seq.seq_id] = (first, [*held, rows])
            if sum(len(r) for r in held) + len(rows) >= FLUSH_ROWS:
                full.append(seq)
        self.catch_up(full)

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Runs the head over the states each sequence holds, in one pass; its last output is kept. Every
        block they lie in is still the sequence's: models with MTP layers have recurrent ones, which
        refuse the policies that drop blocks (kvgen.engine.recurrent)."""
        passes = []
        for seq in seqs:
            first, held = self.pending.pop(seq.seq_id, (0, []))
            hidden = torch.cat(held) if held else None
            if hidden is not None and len(hidden):
                passes.append(HeadChunk(seq, first, seq.token_ids[first + 1 : first + 1 + len(hidden)],
                                        completes_sequence=False, hidden=hidden))
        if not passes:
            return
        self.runner.execute(passes)
        for p in passes:
            self.last[p.seq.seq_id] = (p.start + p.num_tokens - 1, self.runner.kept_hidden[p.seq.seq_id][1][-1])

    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        self.catch_up([c.seq for c in chunks if c.seq.seq_id in self.pending])
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        ready = [(i, self.last[c.seq.seq_id][1]) for i, c in enumerate(chunks)
                 if self.last.get(c.seq.seq_id, (None,))[0] == c.seq.num_tokens - 2]
        logits = self.head.logits(torch.stack([h for _, h in ready])) if ready else None  # [len(ready), vocab]
        while ready:
            seqs = [chunks[i].seq for i, _ in ready]
            tokens, q, sure = draft_tokens(logits, seqs)
            following = []
            for row, (i, h) in enumerate(ready):
                drafts[i].append(tokens[row])
                if q is not None and q[row] is not None:
                    probs[i].append(q[row])
                if len(drafts[i]) < chunks[i].num_lookahead and sure[row] >= self.p_min:
                    position = seqs[row].num_tokens - 2 + len(drafts[i])
                    following.append((i, HeadChunk(seqs[row], position, [tokens[row]], hidden=h[None])))
            if not following:
                break
            logits = self.runner.execute([p for _, p in following])
            ready = [(i, self.runner.kept_hidden[p.seq.seq_id][1][0]) for i, p in following]
        return [Proposal(d, torch.stack(q) if q and not c.seq.params.greedy else None)
                for d, q, c in zip(drafts, probs, chunks)]

    def forget(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)
        self.pending.pop(seq_id, None)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.cache.copy_blocks(copies)

    def capacity_report(self) -> str:
        tokens = self.kv.num_blocks * self.kv.block_size
        return (f"MTP head KV: the same {self.kv.num_blocks} block ids in a pool of its own, "
                f"{format_bytes(tokens * self.bytes_per_token)} ({self.bytes_per_token} bytes/token)")
