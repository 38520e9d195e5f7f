"""GGUF tokenizers against transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the same
file: byte-level BPE (`gpt2`) under each pre-tokenizer, and the SentencePiece-style `llama` vocabulary."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from kvgen.loaders import load_model
from kvgen.loaders.gguf_vocab import PRE_TOKENIZERS, stop_token_ids
from kvgen.loaders.tokenizers import byte_level_bpe
from kvgen.tokenizer import IncrementalDetokenizer
from tests.loaders.gguf_builder import Dims, QType, gpt2_vocab, llama_vocab, random_model, write_gguf
from tests.loaders.test_gguf_smollm2 import TEXTS

SMALL = Dims(hidden=64, inter=128, layers=1, heads=4, kv_heads=2)
MORE_TEXTS = TEXTS + ["<think>reasoning</think> done", "3.14159 2718281828 0x1F", "I'M HERE, it's ok"]


def _tokenizers(path: Path):
    from transformers import AutoTokenizer

    return load_model(path).tokenizer, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _file(tmp_path: Path, vocab, name="tok.gguf") -> Path:
    return write_gguf(tmp_path / name, random_model(QType.F32, len(vocab.tokens), SMALL), vocab, SMALL)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm", "default"])
def test_byte_level_bpe_ids_equal_transformers(pre, tmp_path):
    ours, reference = _tokenizers(_file(tmp_path, gpt2_vocab(pre)))
    assert ours.vocab_size == len(reference)
    for text in MORE_TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert ours.encode("<|im_start|>") == [1] and ours.decode([1, 2]) == ""  # control: whole, not decoded


# Pieces each pre-tokenizer must cut, in the byte alphabet (Ġ = space, Ċ = newline), worked out by hand
# from the regexes' definitions: digit grouping, newline runs, punctuation before letters, 'S.
SPLIT_TEXT = "x.abc 12345\n\n\nx IT'S"
SPLITS = {
    "gpt2": ["x", ".", "abc", "Ġ12345", "ĊĊ", "Ċ", "x", "ĠIT", "'", "S"],
    "llama-bpe": ["x", ".abc", "Ġ", "123", "45", "ĊĊĊ", "x", "ĠIT", "'S"],
    "qwen2": ["x", ".abc", "Ġ", "1", "2", "3", "4", "5", "ĊĊĊ", "x", "ĠIT", "'S"],
    "smollm": ["x", ".", "abc", "Ġ", "1", "2", "3", "4", "5", "ĊĊ", "Ċ", "x", "ĠIT", "'", "S"],
}


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_pre_tokenizer_splits(pre):
    tok = byte_level_bpe(["a"], [], PRE_TOKENIZERS[pre])
    assert [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)] == SPLITS[pre]


def test_unknown_pre_tokenizer_warns_and_uses_default(tmp_path, caplog):
    path = _file(tmp_path, gpt2_vocab("a-new-model"))
    with caplog.at_level(logging.WARNING, logger="kvgen.loaders.gguf_vocab"):
        ours = load_model(path).tokenizer
    assert "unknown tokenizer.ggml.pre 'a-new-model'" in caplog.text and str(path) in caplog.text
    default = load_model(_file(tmp_path, gpt2_vocab("default"), "default.gguf")).tokenizer
    assert all(ours.encode(t) == default.encode(t) for t in MORE_TEXTS)


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_is_honoured(add_bos, tmp_path):
    vocab = gpt2_vocab("smollm")
    vocab = dataclasses.replace(vocab, extra={"add_bos_token": add_bos, "chat_template": "{{ messages }}"})
    ours, reference = _tokenizers(_file(tmp_path, vocab))
    assert ours.encode("Hello there") == reference("Hello there").input_ids
    assert (ours.encode("Hello there")[0] == vocab.bos) == add_bos
    assert ours.encode("Hello there", add_special_tokens=False)[0] != vocab.bos
    assert ours.chat_template == "{{ messages }}"


def test_streaming_detokenization_never_splits_a_character(tmp_path):
    """The tiny vocabulary has few merges, so every non-ASCII character is several byte tokens."""
    tokenizer = load_model(_file(tmp_path, gpt2_vocab("smollm"))).tokenizer
    text = "Café 日本語 🙂🚀 — ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 2
    after_cafe = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]) == "Café")
    for prompt_len in (0, after_cafe):
        prompt = tokenizer.decode(ids[:prompt_len])
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:prompt_len])
        pieces = [detokenizer.add([i]) for i in ids[prompt_len:]]
        assert prompt + "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_sentencepiece_style_vocabulary_ids_equal_transformers(tmp_path, stories_dir):
    ours, reference = _tokenizers(_file(tmp_path, llama_vocab(stories_dir)))
    for text in ["Once upon a time, there was a little girl named Lily.", "Tom said: \"Hi!\" 123 times",
                 "a b  c", "Unicode: café 日本"]:
        assert ours.encode(text) == reference(text).input_ids, text


@pytest.mark.parametrize("eot", [None, 3])
def test_a_harmony_reply_ends_at_return_or_call_not_at_end(eot):
    """gpt-oss: <|end|> closes the analysis message before the final answer; <|return|> and <|call|> end
    the reply, whatever end-of-turn token the file names (llama.cpp's rule)."""
    tokens = ["a", "<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|start|>"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 3, 3, 3, 3, 3],
            "tokenizer.ggml.eos_token_id": 2} | ({} if eot is None else {"tokenizer.ggml.eot_token_id": eot})
    assert stop_token_ids(meta) == (2, 4)
    phi3 = {**meta, "tokenizer.ggml.tokens": [t if t != "<|call|>" else "<|x|>" for t in tokens]}
    assert 3 in stop_token_ids(phi3)  # elsewhere (Phi-3) <|end|> ends the turn
