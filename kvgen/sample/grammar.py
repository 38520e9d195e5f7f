"""Structured outputs: a request's grammar, compiled by xgrammar against the model's vocabulary, and
one matcher per sequence, advanced on each sampled token.

    GrammarSpec (a JSON schema, any JSON object, a regex, a choice of strings; plain data on SamplingParams)
      -> GrammarCompiler.compile (once per request; xgrammar caches compiled grammars) -> Grammar
      -> Grammar.matcher() per sequence -> GrammarState: fill its row of the batch's token bitmask,
         accept each sampled token

The sampler asks for masks only when a row has a grammar, so requests without one pay nothing.
xgrammar was chosen over llguidance by the per-step cost at batch 64 on SmolLM2's 49152-token
vocabulary (BENCHMARKS.md): mask fill 1.0 ms vs 1.9 ms, token accept 0.26 ms vs 0.91 ms, compile of a
nested schema with the tokenizer 20 ms vs 420 ms. It is imported on the first grammar (it takes
seconds to import), not with the engine.

The vocabulary is read through kvgen's Tokenizer interface alone, so that any tokenizer works: a
token's bytes are its text decoded after a plain one-character token (so SentencePiece pieces keep
their leading space). Tokens whose text is part of a UTF-8 character, and special tokens, have no
bytes that way; the grammar never allows them (besides the stop tokens, which end a finished
grammar), so a constrained output spells non-ASCII characters with whole-character tokens only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal

import torch

from kvgen.errors import InvalidRequestError
from kvgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

GrammarKind = Literal["json_schema", "json_object", "regex", "choice"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. `source`: the schema as JSON text, the regex, or the
    choices as a JSON list; `strict` (JSON schemas): no properties or items beyond the schema's."""

    kind: GrammarKind
    source: str
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = True) -> "GrammarSpec":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict)

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object", json.dumps({"type": "object"}), strict=False)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(choices))

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "regex", "choice") or not isinstance(self.source, str):
            raise InvalidRequestError(f"not a grammar: {self.kind!r}")


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: "xgrammar.GrammarMatcher") -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of a batch bitmask [B, ceil(vocab / 32)]."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; True once the grammar is done (it has taken a stop token)."""
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled outside its grammar")
        return self._matcher.is_terminated()


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, shared by the sequences of a request; each gets its own state."""

    spec: GrammarSpec
    compiled: "xgrammar.CompiledGrammar"

    def matcher(self) -> GrammarState:
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(self.compiled))


class GrammarCompiler:
    """Compiles GrammarSpecs against one model's vocabulary; built on the first grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (its logits' width), which may pass the tokenizer's

    @cached_property
    def _compiler(self) -> "xgrammar.GrammarCompiler":
        import xgrammar

        info = xgrammar.TokenizerInfo(token_bytes(self.tokenizer, self.vocab_size), xgrammar.VocabType.RAW,
                                      vocab_size=self.vocab_size, stop_token_ids=sorted(self.tokenizer.stop_token_ids))
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Raises InvalidRequestError for a schema or regex that does not compile, naming the problem."""
        try:
            return Grammar(spec, self._compile(spec))
        except RuntimeError as error:  # xgrammar reports every malformed input as a RuntimeError
            reason = str(error).strip().splitlines()[-1]
            raise InvalidRequestError(f"invalid {_NAMES[spec.kind]}: {reason.split(': ', 1)[-1]}") from None

    def _compile(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        compiler = self._compiler
        if spec.kind in ("json_schema", "json_object"):
            _check_json(spec.source)
            # No free whitespace: a small model may otherwise fill its tokens with spaces.
            return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        choices = json.loads(spec.source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings")
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "guided_choice"}


def _check_json(source: str) -> None:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"invalid JSON schema: not JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("invalid JSON schema: a schema is an object or a boolean")


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token's bytes as it adds them to a text (b"" for special tokens, ids past the tokenizer's
    vocabulary, and pieces of a UTF-8 character)."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    prefix = tokenizer.decode(anchor)
    result = []
    for token_id in range(vocab_size):
        if token_id >= tokenizer.vocab_size:
            result.append(b"")
            continue
        text = tokenizer.decode(anchor + [token_id])[len(prefix):]
        result.append(b"" if "\ufffd" in text else text.encode("utf-8"))
    return result


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """logits [B, vocab] -> a copy where each row with a grammar keeps only the tokens it allows
    (the others -inf); rows without one are as they were. Call only when some row has a grammar."""
    import xgrammar

    rows = [i for i, state in enumerate(states) if state is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(states), logits.shape[-1])  # [B, ceil(vocab / 32)] int32
    for i in rows:
        states[i].fill(bitmask, i)
    masked = logits.clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), indices=rows)
    return masked
