"""The three tokenizer implementations behind `kvgen.tokenizer.Tokenizer`.

- `HFTokenizer`: a Hugging Face `tokenizer.json` (library `tokenizers`), or a BPE built with that
  library from a vocabulary and merges: byte-level (`byte_level_bpe`: GGUF `gpt2` tokenizers) or
  SentencePiece-style with byte fallback (`spm_bpe`: GGUF `gemma4` tokenizers).
- `SentencePieceTokenizer`: a SentencePiece `tokenizer.model` (library `sentencepiece`).
- `BPEVocabTokenizer`: the SentencePiece-BPE vocabulary llama2.c `tok*.bin` files and GGUF files carry
  (pieces + scores, no merges list), encoded the way llama2.c and llama.cpp do it.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kvgen.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where a .model file is opened (kvgen.loaders.hf): optional elsewhere
    import sentencepiece

SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`; BOS comes from its post-processor, or is prepended when `add_bos` asks."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool | None = None,
        extra_stop_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.extra_stop_ids = frozenset(extra_stop_ids) - {self.eos_token_id}
        self.chat_template = chat_template
        self._post_processor_adds_bos = self.bos_token_id is not None and self._raw_encode("", True)[:1] == [
            self.bos_token_id
        ]
        self.add_bos = self._post_processor_adds_bos if add_bos is None else add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._raw_encode(text, add_special_tokens)
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        elif not self.add_bos and self._post_processor_adds_bos:
            del ids[0]  # tokenizer_config.json's add_bos_token: false overrides the post-processor
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def _raw_encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Iterable[str],
    split_regexes: Sequence[str],
    *,
    special_ids: Iterable[int] = (),
    added_ids: Iterable[int] = (),
) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE: `tokens[i]` has id i, `merges` are "left right" pairs, best first.

    Text is cut by each regex of `split_regexes` in turn (each piece kept, as llama.cpp chains them),
    then mapped to GPT-2's printable byte alphabet and merged. Tokens in `special_ids` are special
    (matched whole, never split, skipped by decode); those in `added_ids` are matched whole but kept.
    A token not spelled in the byte alphabet is respelled into it, and is not made special.
    """
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())

    def in_alphabet(token: str) -> bool:
        return set(token) <= alphabet

    vocab = {t if in_alphabet(t) else spell.pre_tokenize_str(t)[0][0]: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split_regexes] + [spell]
    )
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i in special_ids if tokens[i] and in_alphabet(tokens[i])]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    added = [tokens[i] for i in added_ids if tokens[i] in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def spm_bpe(
    tokens: Sequence[str],
    merges: Iterable[str],
    *,
    special_ids: Iterable[int] = (),
    added_ids: Iterable[int] = (),
) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE over merges, as llama.cpp runs a `gemma4` vocabulary: spaces become
    '▁' (no prefix), the text is cut only at runs of newlines, merges apply by rank, and a piece with
    no token is spelled in its UTF-8 bytes (`<0xNN>` tokens). Special and added tokens as in
    `byte_level_bpe`."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids if tokens[i]])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in added_ids if tokens[i]])
    return tok


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; BOS is prepended by us (SentencePiece itself never adds it)."""

    def __init__(
        self,
        processor: sentencepiece.SentencePieceProcessor,
        *,
        add_bos: bool = True,
        extra_stop_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._sp = processor
        self.vocab_size = processor.vocab_size()
        self.bos_token_id = _id_or_none(processor.bos_id())
        self.eos_token_id = _id_or_none(processor.eos_id())
        self.bos_token = processor.id_to_piece(self.bos_token_id) if self.bos_token_id is not None else None
        self.eos_token = processor.id_to_piece(self.eos_token_id) if self.eos_token_id is not None else None
        self.add_bos = add_bos
        self.extra_stop_ids = frozenset(extra_stop_ids) - {self.eos_token_id}
        self.chat_template = chat_template
        self._skipped = frozenset(
            i for i in range(self.vocab_size) if processor.is_control(i) or processor.is_unknown(i)
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._sp.decode([i for i in token_ids if i not in self._skipped and 0 <= i < self.vocab_size])


class BPEVocabTokenizer(Tokenizer):
    """SentencePiece-style BPE from a scored vocabulary, as llama2.c's `encode` and llama.cpp's SPM tokenizer run it.

    Encoding: a space is put in front of the text (SentencePiece's dummy prefix), each character becomes
    a symbol, and adjacent symbols are merged, best-scoring merged piece first (leftmost on ties), while
    the merged piece is in the vocabulary. Characters the vocabulary lacks become `<0xXX>` byte tokens.
    Special-token text (e.g. "<s>") in the input becomes that token, and so does a user-defined piece's
    (Gemma's runs of spaces, tabs and newlines: SentencePiece matches them whole, before merging), which
    decodes as its text. Unlike SentencePiece, runs of spaces are kept as they are, so
    `decode(encode(text)) == text` for any text.

    Pieces may spell spaces ' ' (llama2.c tok.bin) or '▁' (GGUF); both are read as ' '.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        scores: Sequence[float],
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        special_ids: Iterable[int] = (),
        user_defined_ids: Iterable[int] = (),
        add_bos: bool = True,
        add_dummy_prefix: bool = True,
        extra_stop_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        if len(pieces) != len(scores):
            raise ValueError(f"{len(pieces)} pieces but {len(scores)} scores")
        self.vocab_size = len(pieces)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.bos_token = pieces[bos_token_id] if bos_token_id is not None else None
        self.eos_token = pieces[eos_token_id] if eos_token_id is not None else None
        self.add_bos = add_bos
        self.extra_stop_ids = frozenset(extra_stop_ids) - {eos_token_id}
        self.chat_template = chat_template
        self._unk_id = unk_token_id
        self._dummy_prefix = add_dummy_prefix
        special = {i for i in (bos_token_id, eos_token_id, unk_token_id, *special_ids) if i is not None}
        self._build_tables([p.replace(SPM_SPACE, " ") for p in pieces], special, set(user_defined_ids) - special)
        self._merge_scores = dict(zip(self._piece_ids, map(float, map(scores.__getitem__, self._piece_ids.values()))))

    def _build_tables(self, pieces: list[str], special: set[int], user_defined: set[int]) -> None:
        """Lookup tables: mergeable piece -> id (its first id), byte -> id (the first), whole-match text
        -> id (special and user-defined pieces), and id -> bytes for decode (special pieces decode to
        nothing). Built with whole-list operations: a 128k vocabulary is part of every load."""
        byte_values = {i: int(m.group(1), 16) for i, piece in enumerate(pieces)
                       if piece.startswith("<0x") and i not in special and (m := _BYTE_PIECE.fullmatch(piece))}
        self._byte_ids: dict[int, int] = {}
        for i, value in byte_values.items():
            self._byte_ids.setdefault(value, i)
        kept = [i for i in range(len(pieces)) if i not in special and i not in byte_values]
        self._piece_ids: dict[str, int] = dict(zip(map(pieces.__getitem__, reversed(kept)), reversed(kept)))
        self._decoded: list[bytes] = [piece.encode("utf-8") for piece in pieces]  # b"" for special tokens
        self._is_byte: list[bool] = [False] * len(pieces)
        for i in special:
            self._decoded[i] = b""
        for i, value in byte_values.items():
            self._decoded[i], self._is_byte[i] = bytes([value]), True
        self._special_ids = {pieces[i]: i for i in sorted(special | user_defined) if pieces[i]}
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos and self.bos_token_id is not None else []
        # Like llama.cpp, the dummy prefix goes on the first text segment and on each one after a special token.
        for segment, special_id in self._split_special(text):
            if special_id is not None:
                ids.append(special_id)
            elif segment:
                ids.extend(self._encode_segment(" " + segment if self._dummy_prefix else segment))
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Joins the pieces' bytes; the first piece loses its leading space (the dummy prefix), as in SentencePiece."""
        out = bytearray()
        at_start = True
        for i in token_ids:
            if not 0 <= i < self.vocab_size or not self._decoded[i]:
                continue
            piece = self._decoded[i]
            if at_start and self._dummy_prefix and not self._is_byte[i] and piece.startswith(b" "):
                piece = piece[1:]
            at_start = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def _split_special(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut into (segment, None) for plain text and (special text, id) for special tokens."""
        if self._special_re is None:
            return [(text, None)]
        parts: list[tuple[str, int | None]] = []
        start = 0
        for m in self._special_re.finditer(text):
            parts += [(text[start : m.start()], None), (m.group(), self._special_ids[m.group()])]
            start = m.end()
        return parts + [(text[start:], None)]

    def _encode_segment(self, text: str) -> list[int]:
        return [i for symbol in _bpe_merge(text, self._merge_scores) for i in self._symbol_ids(symbol)]

    def _symbol_ids(self, symbol: str) -> list[int]:
        """The id of a final symbol, or its UTF-8 bytes as byte tokens (or unk) when the vocabulary lacks it."""
        piece_id = self._piece_ids.get(symbol)
        if piece_id is not None:
            return [piece_id]
        fallback = [self._byte_ids.get(b, self._unk_id) for b in symbol.encode("utf-8")]
        if None in fallback:
            if self._unk_id is None:
                raise ValueError(f"cannot encode {symbol!r}: no byte tokens and no unknown token")
            return [self._unk_id]
        return fallback  # type: ignore[return-value]


def _bpe_merge(text: str, merge_scores: dict[str, float]) -> list[str]:
    """Merges adjacent symbols of `text` (one per character) into vocabulary pieces, best score first.

    Ties go to the leftmost pair, as in SentencePiece and llama2.c. A heap of candidate pairs over a linked
    list of symbols makes it O(n log n) rather than llama2.c's O(n^2) rescans.
    """
    symbols = list(text)  # "" marks a symbol merged into its left neighbour
    nxt = [*range(1, len(text)), -1]
    prev = list(range(-1, len(text) - 1))
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int) -> None:
        right = nxt[left] if left >= 0 else -1
        merged = symbols[left] + symbols[right] if right >= 0 else ""
        if merged in merge_scores:
            heapq.heappush(heap, (-merge_scores[merged], left, right, merged))

    for i in range(len(text) - 1):
        push(i)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not symbols[left] or nxt[left] != right or symbols[left] + symbols[right] != merged:
            continue  # stale: a side was merged away or grew since this pair was pushed
        symbols[left], symbols[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left])
        push(left)
    return [s for s in symbols if s]


def _id_or_none(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None
