"""Grammars in the engine: the vocabulary adapter, per-sequence grammar state (n > 1, ignore_eos, a
small KV cache that preempts), and 400-style errors for what does not compile."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvgen import LLM, SamplingParams
from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import GrammarSpec, token_bytes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512)


def test_token_bytes_spell_what_the_tokenizer_decodes(llm):
    tok = llm.tokenizer
    vocab = token_bytes(tok, llm.engine.model_config.vocab_size + 3)
    assert vocab[-3:] == [b"", b"", b""]  # past the tokenizer's vocabulary
    assert all(vocab[i] == b"" for i in tok.stop_token_ids)
    ids = tok.encode("Once upon a time, Lily said hi.", add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids).decode() == " Once upon a time, Lily said hi."  # SentencePiece's space


def test_each_completion_has_its_own_grammar_state(llm):
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=120, grammar=GrammarSpec.json_schema(SCHEMA))
    out = llm.generate("Once upon a time", params)[0]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_finished_grammar_stops_under_ignore_eos(llm):
    out = llm.generate("Tom", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                             grammar=GrammarSpec.choice(["yes", "no"])))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_grammar_survives_preemption():
    """Eight sequences on a cache too small for all of them: the preempted ones are recomputed and
    their grammar state goes on where it was."""
    small = LLM(num_kv_blocks=12, block_size=8, max_num_seqs=8)  # 96 slots for 8 x ~45 tokens
    regex = r"[a-z ]{100,140}\."
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, grammar=GrammarSpec.regex(regex))
              for i in range(8)]
    outs = small.generate(["Once upon a time there was a girl"] * 8, params)
    assert small.engine.stats().num_preemptions > 0
    for out in outs:
        assert re.fullmatch(regex, out.text), out.text


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema('{"type": "object", "properties": []}'),
                                  GrammarSpec.json_schema("{not json"), GrammarSpec.regex("a{3,1}"),
                                  GrammarSpec.choice([])], ids=["properties a list", "not JSON", "bad bounds",
                                                                "no choices"])
def test_what_does_not_compile_is_an_invalid_request(llm, spec):
    with pytest.raises(InvalidRequestError, match=r"^invalid |guided_choice"):
        llm.engine.compile_grammar(SamplingParams(grammar=spec))
