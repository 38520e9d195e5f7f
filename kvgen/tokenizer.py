"""Tokenizers behind one interface, and incremental detokenization.

Implementations (in `kvgen.loaders.tokenizers`): Hugging Face `tokenizer.json` (library `tokenizers`),
SentencePiece `tokenizer.model` (library `sentencepiece`), and the SentencePiece-style BPE vocabulary
that llama2.c `tok*.bin` files and GGUF files carry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Text <-> token ids for one model."""

    vocab_size: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Ids that end generation besides EOS (llama2.c models stop when BOS reappears).
    extra_stop_ids: frozenset[int] = frozenset()
    # Whether `encode` puts BOS in front (SentencePiece Llamas do; many BPE models don't).
    add_bos: bool = True
    # Jinja chat template from tokenizer_config.json, when the model ships one.
    chat_template: str | None = None
    # Special tokens as text, for chat templates (e.g. "<s>", "</s>").
    bos_token: str | None = None
    eos_token: str | None = None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS in front when `add_special_tokens` and the model wants it."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped; incomplete UTF-8 comes out as U+FFFD."""

    @property
    def stop_token_ids(self) -> frozenset[int]:
        ids = set(self.extra_stop_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a multibyte character.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits only
    the difference, holding back while the window ends in an incomplete character (U+FFFD). Decoding
    a window rather than each token alone keeps the spaces SentencePiece tokenizers attach to tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = list(prompt_token_ids)
        # Start the window a few tokens into the prompt so the first output token decodes in context.
        self.prefix_offset = max(len(self.token_ids) - 5, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends tokens and returns the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        # A character whose first bytes came earlier decodes as U+FFFD until complete: compare without it.
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset]).rstrip("\ufffd")
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        if not self.tokenizer.decode(self.token_ids[self.read_offset :]).startswith("\ufffd"):
            self.prefix_offset = self.read_offset  # the next window starts on a character boundary
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
