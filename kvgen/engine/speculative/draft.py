"""A draft model proposes: a smaller model sharing the target's tokenizer, or a 4-bit copy of the
target itself (self-speculation: the same checkpoint with draft_quantization int4).

The draft has its own K/V pools but no block tables of its own: it reads and writes the same block
ids as the target, through the target's KVCacheManager, so its cache lives and dies with the
target's (allocation, preemption, rollback, copy-on-write). Per sequence it remembers how many
tokens it has computed. Proposing K tokens for a decode of a sequence of N tokens:

    prefill     the target's prompt chunks are computed by the draft in the same step
    pass 0      catch up: tokens [computed, N) (the last token, when in step)     -> d_1
    pass j      d_j at position N + j - 1                                          -> d_{j+1}
    after       the target verified m drafts: tokens [0, N + m) are right, so
                computed = min(N + K - 1, N + m)

All slots it writes were reserved for the target's verify chunk (positions N - 1 .. N + K - 1).
A prefix-cache hit gives the target blocks whose draft K/V may never have been computed, so the
draft computes every sequence from its first live token itself (writing the same values again into
a shared block is harmless; the draft's numbers only steer proposals, never the output).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvgen.cache.kv_manager import KVCacheManager
from kvgen.cache.sizing import format_bytes, kv_bytes_per_token_of
from kvgen.config import EngineConfig, ModelConfig
from kvgen.engine.speculative.draft_vocab import Columns, DraftVocabulary
from kvgen.engine.speculative.proposer import Proposal, Proposer
from kvgen.errors import ModelLoadError
from kvgen.loaders import LoadedModel
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.kernels.paged_decode import paged_decode_for
from kvgen.model.kv_quant import STORAGE_DTYPES
from kvgen.model.decoder import DecoderModel, head_weight
from kvgen.runner.model_runner import Head, ModelRunner
from kvgen.sample.sampler import filtered_probs
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence


# A packed draft quantizes x to one int8 part per 32 values, as ggml does, not the target's two
# (kvgen.model.linear_choice.ACTIVATIONS): its numbers only steer proposals, and one part halves
# the integer kernel's work. A SmolLM2 Q4_1 step's matrices at 1 / 2 rows: 5.9 / 9.7 ms -> 4.6 / 5.9.
DRAFT_ACTIVATIONS = "int8"


@dataclass
class DraftChunk:
    """What the runner reads of a chunk, for a draft pass: `tokens` from `start`, the last one's logits."""

    seq: Sequence
    start: int
    tokens: list[int]
    draft: list[int] = field(default_factory=list)
    completes_sequence: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return self.tokens


def draft_tokens(logits: torch.Tensor, seqs: list[Sequence], columns: Columns | None = None,
                 vocab_size: int = 0) -> tuple[list[int], list[torch.Tensor | None] | None, list[float]]:
    """logits [B, C] over columns whose token ids `columns` names (None: each column is its id, C the
    vocabulary) -> per row the draft token, its q, and the draft's probability of it. A greedy request
    takes the argmax; a sampled one draws under its temperature / top-k / top-p / min-p, and its q,
    over the whole vocabulary of `vocab_size` ids (zero where no column names an id), is what the
    verify's rejection sampler takes. The probability (for draft_p_min) is q's where drawn, else the
    softmax's, exp(logit - logsumexp) (no [rows, C] softmax a pass)."""
    logits = logits.float()
    picked = logits.argmax(dim=-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    q: list[torch.Tensor | None] | None = None
    if sampled:
        q = [None] * len(seqs)
        rows = filtered_probs(logits[torch.tensor(sampled)], [seqs[i].params for i in sampled]).cpu()
        for row, i in zip(rows, sampled):
            picked[i] = int(torch.multinomial(row, 1, generator=seqs[i].generator))
            q[i] = row if columns is None else columns.spread(i, row, vocab_size)
    chosen = logits.gather(-1, picked[:, None])[:, 0]
    plain = (chosen - torch.logsumexp(logits, -1)).exp().tolist()
    picked_columns = picked.tolist()
    tokens = picked_columns if columns is None else [columns.token(i, c) for i, c in enumerate(picked_columns)]
    sure = [float(q[i][token]) if q is not None and q[i] is not None else plain[i] for i, token in enumerate(tokens)]
    return tokens, q, sure


def check_vocabulary(draft: ModelConfig, target: ModelConfig, path: object) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(path, f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                                   f"{target.vocab_size}: a draft must share the target's tokenizer")


class DraftProposer(Proposer):
    def __init__(self, loaded: LoadedModel, target: ModelConfig, config: EngineConfig, kv: KVCacheManager) -> None:
        check_vocabulary(loaded.config, target, config.draft_model)
        cfg = loaded.config
        weights = {**loaded.weights, **loaded.quantized}
        size = config.draft_vocab_size if 0 < config.draft_vocab_size < cfg.vocab_size else None
        self.model = DecoderModel(cfg, weights, config.device, config.torch_dtype, config.draft_weights,
                                  config.fused_decode, DRAFT_ACTIVATIONS, head_rows=size)
        self.vocabulary = None if size is None else DraftVocabulary(self.model, head_weight(cfg, weights), size)
        self.vocab_size = cfg.vocab_size
        pool_dtype = STORAGE_DTYPES[config.kv_dtype]
        self.cache = PagedKVCache(cfg.num_layers, kv.num_blocks, kv.block_size, cfg.num_kv_heads, cfg.head_dim,
                                  self.model.device, pool_dtype, compute_dtype=self.model.dtype)
        kernel = paged_decode_for(config.attention_backend, self.model.device, self.model.dtype, pool_dtype)
        self.runner = ModelRunner(self.model, self.cache, kv, kernel)
        self.kv = kv
        # A sequence's drafting stops after a token the draft gives less than this (as llama.cpp's
        # `--draft-p-min`): on free text each further draft step and verify row would mostly be wasted;
        # a speculative step cost ~3.5 plain ones on the real Qwen2.5-Coder pair where it kept ~2.3 tokens.
        self.p_min = config.draft_p_min
        self.bytes_per_token = kv_bytes_per_token_of(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.kv_dtype)
        self.computed: dict[int, int] = {}  # seq_id -> tokens whose draft K/V are in the pools

    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        passes = [(i, self._catch_up(c.seq)) for i, c in enumerate(chunks)]
        while passes:
            seqs = [p.seq for _, p in passes]
            logits = self.runner.execute([p for _, p in passes], head=self._head(seqs))
            columns = None if self.vocabulary is None else self.vocabulary.columns(seqs)
            tokens, q, sure = draft_tokens(logits, seqs, columns, self.vocab_size)
            following = []
            for row, (i, p) in enumerate(passes):
                drafts[i].append(tokens[row])
                if q is not None and q[row] is not None:
                    probs[i].append(q[row])
                self.computed[p.seq.seq_id] = p.start + p.num_tokens
                if len(drafts[i]) < chunks[i].num_lookahead and sure[row] >= self.p_min:
                    following.append((i, DraftChunk(p.seq, p.start + p.num_tokens, [tokens[row]])))
            passes = following
        return [Proposal(d, torch.stack(q) if q and not c.seq.params.greedy else None)
                for d, q, c in zip(drafts, probs, chunks)]

    def _head(self, seqs: list[Sequence]) -> Head | None:
        """The logits of a pass over these sequences' last rows: over the draft's vocabulary where it has
        one (DraftVocabulary: its columns named by `columns`), else its LM head's over every id."""
        return None if self.vocabulary is None else functools.partial(self.vocabulary.logits, seqs=seqs)

    def prefill(self, chunks: list[ScheduledChunk]) -> None:
        """Computes the draft's K/V of the target's prompt chunks (and whatever it lacks before them)."""
        passes = [DraftChunk(c.seq, start, c.seq.token_ids[start : c.start + c.num_tokens]) for c in chunks
                  if (start := self._first_missing(c.seq)) < c.start + c.num_tokens]
        if passes:
            self.runner.execute(passes)
            self.computed.update((p.seq.seq_id, p.start + p.num_tokens) for p in passes)

    def _catch_up(self, seq: Sequence) -> DraftChunk:
        """The pass computing every token the draft lacks, up to the sequence's last."""
        start = min(self._first_missing(seq), seq.num_tokens - 1)
        return DraftChunk(seq, start, seq.token_ids[start:])

    def _first_missing(self, seq: Sequence) -> int:
        """The first token whose draft K/V are not in the pools (never one in a block the policy dropped)."""
        live = self.kv.live_blocks(seq.seq_id)
        first_live = live[0][0] * self.kv.block_size if live else 0
        return max(self.computed.get(seq.seq_id, 0), first_live)

    def rollback(self, seq: Sequence) -> None:
        if seq.seq_id in self.computed:
            self.computed[seq.seq_id] = min(self.computed[seq.seq_id], seq.num_computed_tokens)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)
        if self.vocabulary is not None:
            self.vocabulary.forget(seq_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.cache.copy_blocks(copies)

    def capacity_report(self) -> str:
        tokens = self.kv.num_blocks * self.kv.block_size
        return (f"draft KV: the same {self.kv.num_blocks} block ids in its own pools, "
                f"{format_bytes(tokens * self.bytes_per_token)} ({self.bytes_per_token} bytes/token)")
