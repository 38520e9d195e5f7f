"""The tokenizer a GGUF file describes in its `tokenizer.*` metadata.

- `tokenizer.ggml.model == "llama"`: a SentencePiece-style scored vocabulary (`BPEVocabTokenizer`).
- `tokenizer.ggml.model == "gemma4"`: SentencePiece-style BPE from the tokens + merges, with byte
  fallback (`spm_bpe`), as llama.cpp's gemma4 vocabulary.
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE from `tokenizer.ggml.tokens` + `merges`, built with
  the `tokenizers` library. `tokenizer.ggml.pre` names how text is cut before merging; each name maps to
  the regexes llama.cpp chains for it (llama-vocab.cpp). For `default` (and names kvgen does not know,
  after a warning) this is GPT-2's regex, as transformers' GGUF reader uses, where llama.cpp has a
  legacy chain of its own.

Control tokens (`<|im_start|>`, `<|eot_id|>`) are special: matched whole in text, skipped by decode.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gguf import TokenType

from kvgen.errors import ModelLoadError
from kvgen.loaders.chat_templates import builtin_template
from kvgen.loaders.tokenizers import BPEVocabTokenizer, HFTokenizer, byte_level_bpe, spm_bpe
from kvgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r"\p{N}"  # each digit on its own, before the GPT-2 regex (StarCoder-family vocabularies)

# tokenizer.ggml.pre -> the split regexes, applied in turn.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "smollm": (_DIGITS, _GPT2),
    "starcoder": (_DIGITS, _GPT2),
    "refact": (_DIGITS, _GPT2),
    "command-r": (_DIGITS, _GPT2),
}


# Texts of control tokens that end a chat turn, for files whose metadata names no end-of-turn token
# (llama.cpp looks for the same texts): Gemma 3's, ChatML's, Llama 3's, Phi-3's, Gemma 4's.
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<turn|>")
# gpt-oss's harmony (o200k_harmony): a reply ends at <|return|> or at a tool call's <|call|>, while <|end|>
# only closes one of its messages (the analysis before the final answer). llama.cpp's rule: where both
# are in the vocabulary, <|end|> ends nothing.
HARMONY_STOPS = ("<|return|>", "<|call|>")


def gguf_tokenizer(path: Path, meta: dict[str, Any], architecture: str = "llama") -> Tokenizer:
    """The file's own tokenizer; a one-line ModelLoadError when it has none kvgen can build. A file
    without a chat template gets its architecture's usual one where kvgen knows it (Gemma's)."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("llama", "gpt2", "gemma4"):
        raise ModelLoadError(
            path, f"GGUF tokenizer {model!r} is not supported (only 'llama', 'gpt2' and 'gemma4'); pass tokenizer_path"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError(path, "GGUF has no tokenizer.ggml.tokens vocabulary; pass tokenizer_path")
    template = meta.get("tokenizer.chat_template") or builtin_template(architecture)
    if model == "llama":
        return _sentencepiece_style(meta, template)
    return _byte_level(path, meta, template) if model == "gpt2" else _spm_bpe(path, meta, template)


def token_id(meta: dict[str, Any], kind: str) -> int | None:
    """`tokenizer.ggml.{kind}_token_id`, or None when absent or outside the vocabulary (-1 stored as uint32)."""
    value = meta.get(f"tokenizer.ggml.{kind}_token_id")
    n_tokens = len(meta.get("tokenizer.ggml.tokens") or ())
    return int(value) if value is not None and (not n_tokens or value < n_tokens) else None


def stop_token_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """EOS and end-of-turn ids: the metadata's eot/eom where named (Llama 3 instruct ends a turn with
    <|eot_id|>), else the control tokens with a known end-of-turn text (Gemma's <end_of_turn>)."""
    ids = [token_id(meta, "eos"), *_end_of_turn_ids(meta)]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _sentencepiece_style(meta: dict[str, Any], template: str | None) -> BPEVocabTokenizer:
    pieces = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta)
    # Plain ints: an enum member looked up per token cost ~30 ms over a 128k vocabulary.
    special, user_defined = {int(TokenType.UNKNOWN), int(TokenType.CONTROL)}, int(TokenType.USER_DEFINED)
    return BPEVocabTokenizer(
        pieces,
        meta.get("tokenizer.ggml.scores", [0.0] * len(pieces)),
        bos_token_id=token_id(meta, "bos"),
        eos_token_id=token_id(meta, "eos"),
        unk_token_id=token_id(meta, "unknown"),
        special_ids=[i for i, t in enumerate(types) if t in special],
        user_defined_ids=[i for i, t in enumerate(types) if t == user_defined],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        extra_stop_ids=_end_of_turn_ids(meta),
        chat_template=template,
    )


def _byte_level(path: Path, meta: dict[str, Any], template: str | None) -> HFTokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError(path, "GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        log.warning("%s: unknown tokenizer.ggml.pre %r; splitting text as 'default' (GPT-2's regex)", path, pre)
        pre = "default"
    types = _token_types(meta)
    tok = byte_level_bpe(
        tokens,
        merges,
        PRE_TOKENIZERS[pre],
        special_ids=[i for i, t in enumerate(types) if t == TokenType.CONTROL],
        added_ids=[i for i, t in enumerate(types) if t == TokenType.USER_DEFINED],
    )
    bos, eos = token_id(meta, "bos"), token_id(meta, "eos")
    return HFTokenizer(
        tok,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        extra_stop_ids=_end_of_turn_ids(meta),
        chat_template=template,
    )


def _spm_bpe(path: Path, meta: dict[str, Any], template: str | None) -> HFTokenizer:
    """A `gemma4` vocabulary: llama.cpp always adds its BOS (it overrides add_bos_token false)."""
    tokens = meta["tokenizer.ggml.tokens"]
    if not meta.get("tokenizer.ggml.merges"):
        raise ModelLoadError(path, "GGUF gemma4 tokenizer has no tokenizer.ggml.merges")
    types = _token_types(meta)
    control, user_defined = int(TokenType.CONTROL), int(TokenType.USER_DEFINED)
    tok = spm_bpe(tokens, meta["tokenizer.ggml.merges"],
                  special_ids=[i for i, t in enumerate(types) if t == control],
                  added_ids=[i for i, t in enumerate(types) if t == user_defined])
    bos, eos = token_id(meta, "bos"), token_id(meta, "eos")
    return HFTokenizer(tok, bos_token=tokens[bos] if bos is not None else None,
                       eos_token=tokens[eos] if eos is not None else None, add_bos=True,
                       extra_stop_ids=_end_of_turn_ids(meta), chat_template=template)


def _token_types(meta: dict[str, Any]) -> list[int]:
    return meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(meta["tokenizer.ggml.tokens"])


def _end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if all(stop in tokens for stop in HARMONY_STOPS):  # gpt-oss, whatever eot the file names
        return [tokens.index(stop) for stop in HARMONY_STOPS]
    named = [i for i in (token_id(meta, "eot"), token_id(meta, "eom")) if i is not None]
    if named or not tokens:
        return named
    control = int(TokenType.CONTROL)
    return [i for i, (text, kind) in enumerate(zip(tokens, _token_types(meta)))
            if kind == control and text in END_OF_TURN_TEXTS]
