"""Tokenizers: the tok512 vocabulary three ways (llama2.c tok512.bin, GGUF, SentencePiece tok512.model),
a tokenizer.json trained here, and incremental detokenization over all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvgen.loaders import load_model, load_tokenizer
from kvgen.loaders.tokenizers import BPEVocabTokenizer, HFTokenizer, SentencePieceTokenizer
from kvgen.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "héllo wörld 你好 🙂"
# Text SentencePiece leaves as is (its normalizer collapses runs of spaces and strips the ends).
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    'She said: "Hi!" and ran home.\nThe end.\n',
    MULTIBYTE,
    "a\nb\n\nc",
    "tabs\tand 123 4567 digits",
    "x",
    "",
]
# Text only our BPE keeps exactly.
SPACED = ["  two  spaces ", " leading", "trailing ", "\n\n"]


@pytest.fixture(scope="module")
def tok_bin(stories_dir: Path) -> Tokenizer:
    return load_tokenizer(stories_dir / "tok512.bin")


@pytest.fixture(scope="module")
def tok_gguf(stories_dir: Path) -> Tokenizer:
    return load_model(stories_dir / "stories260K.gguf").tokenizer


@pytest.fixture(scope="module")
def tok_sp(stories_dir: Path) -> Tokenizer:
    return load_tokenizer(stories_dir / "tok512.model")


@pytest.fixture(scope="module")
def sp(stories_dir: Path) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(stories_dir / "tok512.model"))


# --- the tok512 vocabulary ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_vocab_encodes_like_sentencepiece(text, tok_bin, tok_gguf, tok_sp, sp):
    expected = [sp.bos_id(), *sp.encode(text)]
    assert tok_bin.encode(text) == expected
    assert tok_gguf.encode(text) == expected
    assert tok_sp.encode(text) == expected
    assert tok_bin.encode(text, add_special_tokens=False) == expected[1:]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(text, tok_bin, tok_gguf, tok_sp, sp):
    for tok in (tok_bin, tok_gguf, tok_sp):
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok_bin.decode(tok_bin.encode(text)) == sp.decode(sp.encode(text))


ALPHABET = st.sampled_from(list("abcdefghijklmnopqrstuvwxyzTOL .,!?\n\t'\"0123456789éö你🙂"))
# Not: lone surrogates (not UTF-8), '▁' (SentencePiece reads it as a space; we keep it) and '<' (we parse "<s>").
ANY_CHARACTER = st.characters(blacklist_categories=("Cs",), blacklist_characters="▁<")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET | ANY_CHARACTER, max_size=60))
def test_bpe_vocab_matches_sentencepiece_on_any_text(stories_dir, text):
    tok, sp = _tok512_pair(stories_dir)
    text = re.sub(" +", " ", text).strip(" ")  # what SentencePiece's normalizer would do first
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text


_TOK512: dict[Path, tuple[Tokenizer, sentencepiece.SentencePieceProcessor]] = {}


def _tok512_pair(stories_dir: Path) -> tuple[Tokenizer, sentencepiece.SentencePieceProcessor]:
    """Loaded once: hypothesis runs the test body many times under one function-scoped fixture set."""
    if stories_dir not in _TOK512:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(stories_dir / "tok512.model"))
        _TOK512[stories_dir] = (load_tokenizer(stories_dir / "tok512.bin"), sp)
    return _TOK512[stories_dir]


@pytest.mark.parametrize("text", SPACED)
def test_bpe_vocab_keeps_every_space(text, tok_bin, tok_gguf):
    assert tok_bin.decode(tok_bin.encode(text)) == text
    assert tok_gguf.encode(text) == tok_bin.encode(text)


def test_special_tokens(tok_bin, tok_gguf, tok_sp):
    for tok in (tok_bin, tok_gguf):
        assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<s>", "</s>", 1, 2)
        # Special-token text becomes the token; the dummy prefix follows it, as in llama.cpp.
        hi = tok.encode("Hi", add_special_tokens=False)
        assert tok.encode("<s>Hi</s>", add_special_tokens=False) == [1, *hi, 2]
        assert tok.decode([1, *hi, 2, 0]) == "Hi"  # BOS, EOS and unk are skipped
    assert tok_sp.decode([1, *tok_sp.encode("Hi", add_special_tokens=False), 2, 0]) == "Hi"
    assert tok_bin.extra_stop_ids == {1} and not tok_gguf.extra_stop_ids


def test_incomplete_utf8_decodes_to_replacement_character(tok_bin, tok_gguf, tok_sp):
    for tok in (tok_bin, tok_gguf, tok_sp):
        ids = tok.encode("🙂", add_special_tokens=False)
        assert len(ids) == 5  # dummy-prefix space + four byte-fallback tokens
        assert tok.decode(ids[:-1]).endswith("\ufffd")
        assert tok.decode(ids) == "🙂"


def test_bpe_vocab_tokenizer_with_either_space_spelling():
    pieces = ["<unk>", "<s>", "</s>", "▁a", "▁", "a", "b", "ab", "▁ab"]
    scores = [0.0, 0.0, 0.0, -1.0, -5.0, -5.0, -5.0, -2.0, -3.0]
    spm = BPEVocabTokenizer(pieces, scores, bos_token_id=1, eos_token_id=2, unk_token_id=0)
    llama2c = BPEVocabTokenizer([p.replace("▁", " ") for p in pieces], scores, bos_token_id=1, eos_token_id=2)
    # "ab b" -> " ab b": best merges first: " a" (-1), then " a"+"b" = " ab" (-3); "b" stays.
    assert spm.encode("ab b") == llama2c.encode("ab b") == [1, 8, 4, 6]
    assert spm.encode("c", add_special_tokens=False) == [4, 0]  # no byte tokens: unknown
    assert spm.decode([1, 8, 4, 6]) == "ab b"


# --- tokenizer.json -------------------------------------------------------------------------------------

CORPUS = ["Once upon a time there was a girl.", "She liked to play in the park.", MULTIBYTE, "héllo again!"]


def _train_byte_level(bos_post_processor: bool) -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _tokenizer_dir(tmp_path: Path, bos_post_processor: bool, settings: dict) -> Path:
    _train_byte_level(bos_post_processor).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    return tmp_path


@pytest.mark.parametrize("bos_post_processor", [True, False])
def test_hf_tokenizer_matches_tokenizers(bos_post_processor, tmp_path):
    settings = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ messages }}"}
    if not bos_post_processor:
        settings["add_bos_token"] = True  # no post-processor: the BOS comes from this flag
    ours = load_tokenizer(_tokenizer_dir(tmp_path, bos_post_processor, settings))
    raw = RawTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert isinstance(ours, HFTokenizer)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (0, 1, True)
    assert ours.chat_template == "{{ messages }}"
    for text in [*TEXTS, *SPACED]:
        plain = raw.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == plain
        assert ours.encode(text) == [0, *plain]  # exactly one BOS either way
        assert ours.decode(ours.encode(text)) == text


def test_hf_tokenizer_add_bos_false_overrides_post_processor(tmp_path):
    settings = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    ours = load_tokenizer(_tokenizer_dir(tmp_path, True, settings))
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False) != []
    assert ours.encode("hi")[0] != ours.bos_token_id


def test_hf_tokenizer_without_bos(tmp_path):
    ours = load_tokenizer(_tokenizer_dir(tmp_path, False, {"eos_token": "</s>"}))
    assert (ours.bos_token_id, ours.add_bos) == (None, False)
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)


def test_sentencepiece_tokenizer_from_tokenizer_model(tok_sp):
    assert isinstance(tok_sp, SentencePieceTokenizer)
    assert (tok_sp.bos_token, tok_sp.eos_token, tok_sp.vocab_size) == ("<s>", "</s>", 512)


# --- incremental detokenization -------------------------------------------------------------------------

STREAMED = f"Once upon a time, {MULTIBYTE}\nThe end, 你好!"


def _stream(tok: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    return [detok.add([token_id]) for token_id in new_ids]


@pytest.mark.parametrize("name", ["tok_bin", "tok_gguf", "tok_sp", "hf"])
@pytest.mark.parametrize("prompt_tokens", [1, 6])
def test_incremental_detokenizer_streams_whole_characters(name, prompt_tokens, request, tmp_path):
    if name == "hf":
        tok = load_tokenizer(_tokenizer_dir(tmp_path, True, {"bos_token": "<s>", "eos_token": "</s>"}))
    else:
        tok = request.getfixturevalue(name)
    ids = tok.encode(STREAMED)
    prompt_ids, new_ids = ids[:prompt_tokens], ids[prompt_tokens:]
    deltas = _stream(tok, prompt_ids, new_ids)
    full, prompt_text = tok.decode(ids), tok.decode(prompt_ids)
    assert full == STREAMED and full.startswith(prompt_text)
    assert "".join(deltas) == full[len(prompt_text) :]
    assert not any("\ufffd" in delta for delta in deltas)
    # The stream really did split characters: some prefixes end inside one.
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))
