"""A draft model's logits over part of the vocabulary, as FR-Spec's and EAGLE-3's drafts: the first
`size` token ids (byte-level BPE numbers tokens by merge order, frequent ones first) and every other
token the sequence holds, prompt and output, so that copying a text never needs a token the draft
cannot name.

The draft's LM head is a large share of a draft step's bytes: the Qwen2.5-Coder-0.5B's output matrix
(151,936 rows) is 145 MB of Q8_0 in the file and 77 MB as the draft keeps it in int4, about a quarter
of what its decode step reads; its first 32,768 rows cover 97% of a Python file's tokens and 91% of
an English story's with Qwen's tokenizer. Proposals stay
exact whatever the draft sees: the target verifies every token. A greedy draft proposes its argmax
over the ids it sees; a sampled draft's distribution q is zero elsewhere, which the rejection
sampler takes as it is (the residual max(p - q, 0) keeps the target's mass there). The draft's
confidence (draft_p_min) is its softmax over the ids it sees.

The sequence's own tokens beyond the first ids are scored on their rows of the head's matrix in
fp32 (a GGUF's blocks read from the file's map, dequantized as gguf does), a few hundred rows at most,
read once each: a pass only looks at the tokens its sequence gained since the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgen.loaders.gguf_tensors import GGUFWeight
from kvgen.model.decoder import DecoderModel
from kvgen.model.linear_choice import Weight
from kvgen.scheduling.sequence import Sequence


def weight_rows(weight: Weight, ids: list[int]) -> torch.Tensor:
    """fp32 rows `ids` of a matrix [rows, in] -> [len(ids), in]."""
    return weight.dequantize_rows(ids) if isinstance(weight, GGUFWeight) else weight[ids].float()


@dataclass
class _OwnTokens:
    """A sequence's tokens beyond the first ids (their ids and their head rows) and how far its text
    was read."""

    read: int = 0
    ids: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None  # [len(ids), hidden] fp32


@dataclass(frozen=True)
class Columns:
    """Which token each column of `DraftVocabulary.logits` names: column c < size is id c, column
    size + j of row r is own[r][j]; the rest of a row is -inf padding, naming none."""

    size: int
    own: list[list[int]]

    def token(self, row: int, column: int) -> int:
        return column if column < self.size else self.own[row][column - self.size]

    def spread(self, row: int, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Row `row`'s probabilities over its columns [C] -> over the whole vocabulary [vocab_size],
        zero at the ids no column names."""
        out = torch.zeros(vocab_size, dtype=probs.dtype)
        out[: self.size] = probs[: self.size]
        own = self.own[row]
        if own:
            out[torch.tensor(own)] = probs[self.size : self.size + len(own)]
        return out


class DraftVocabulary:
    def __init__(self, model: DecoderModel, head: Weight, size: int) -> None:
        """`model`'s LM head covers ids [0, size) (DecoderModel's head_rows); `head` is the whole
        matrix, whose other rows are read as sequences need them."""
        self.model, self.head, self.size = model, head, size
        self._own: dict[int, _OwnTokens] = {}

    def logits(self, hidden: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """hidden [B, hidden] of one row per sequence -> fp32 logits [B, size + M] over the ids the draft
        sees, not the whole vocabulary (an argmax and a logsumexp over the Qwen2.5-Coder-0.5B's 151,936
        ids took ~0.7 ms a pass, over its first 32,768 a fifth of it): the head's on ids [0, size), then
        each sequence's own tokens beyond them, M the most any of them holds (the others' last columns
        -inf). `columns(seqs)` names each column's token."""
        owns = [self._read(seq) for seq in seqs]
        first = self.model.logits(hidden)  # [B, size]
        most = max(len(own.ids) for own in owns)
        if not most:
            return first
        out = torch.cat([first, first.new_full((len(seqs), most), float("-inf"))], dim=1)
        for row, own in enumerate(owns):
            if own.ids:
                scores = hidden[row : row + 1].float() @ own.rows.T  # [1, len(ids)]
                out[row, self.size : self.size + len(own.ids)] = self.model.soft_cap(scores)[0]
        return out

    def columns(self, seqs: list[Sequence]) -> Columns:
        """The token each column of the logits `logits(hidden, seqs)` gave names (their texts as it
        read them)."""
        return Columns(self.size, [self._own[seq.seq_id].ids for seq in seqs])

    def forget(self, seq_id: int) -> None:
        self._own.pop(seq_id, None)

    def _read(self, seq: Sequence) -> _OwnTokens:
        """The sequence's own tokens, its text read from where the last call left off."""
        own = self._own.setdefault(seq.seq_id, _OwnTokens())
        new = [t for t in dict.fromkeys(seq.token_ids[own.read :]) if t >= self.size and t not in own.ids]
        own.read = len(seq.token_ids)
        if new:
            rows = weight_rows(self.head, new).to(self.model.device)
            own.rows = rows if own.rows is None else torch.cat([own.rows, rows])
            own.ids += new
        return own
