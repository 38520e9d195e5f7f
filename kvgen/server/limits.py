"""Bounds on everything a request controls that scales the server's memory or CPU time.

They are checked on the parsed body, before a prompt is tokenized or anything is queued, so that no
single request can hurt the server: a request over a bound gets a 400 that names the field and the
limit. Each bound is a `kvgen serve` option (see docs/serving.md). The model's context already bounds
prompt + max_tokens under the `full` cache policy; `max_tokens` is bounded on its own because a
bounded policy (`sinks`) may run past the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import GrammarSpec
from kvgen.sampling_params import INT64_MAX, INT64_MIN


# Sequences waiting for the engine past which a new request gets 429 (backpressure; see ServerState.admit).
DEFAULT_MAX_QUEUED_REQUESTS = 256


class LimitExceededError(InvalidRequestError):
    """A request field over one of the server's bounds (a 400, counted in /metrics)."""


@dataclass(frozen=True)
class RequestLimits:
    """The largest value a request may ask for, field by field (server options of the same name)."""

    max_n: int = 128  # completions per prompt (OpenAI's own bound)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_choices: int = 256  # n x the number of prompts
    max_tokens: int = 65536  # max_tokens / max_completion_tokens
    max_prompt_tokens: int | None = None  # tokens of one prompt; None: the model's context
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs
    max_stop: int = 16  # stop strings
    max_stop_length: int = 256  # characters of one stop string
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # logit_bias entries
    max_grammar_size: int = 32768  # characters of a structured output's schema (as JSON), regex or choices

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def check_counts(self, *, n: int, num_prompts: int, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None, stop: list[str], stop_token_ids: list[int],
                     logit_bias: dict | None, grammar: GrammarSpec | None = None) -> None:
        """Raises LimitExceededError for the first field over its bound."""
        _within("n", n, self.max_n)
        _within("the number of prompts", num_prompts, self.max_prompts)
        _within("n x the number of prompts", n * num_prompts, self.max_choices)
        _within("max_tokens", max_tokens or 0, self.max_tokens)
        _within("logprobs", logprobs or 0, self.max_logprobs)
        _within("prompt_logprobs", prompt_logprobs or 0, self.max_logprobs)
        _within("the number of stop strings", len(stop), self.max_stop)
        longest = max((len(s) for s in stop), default=0)
        _within("the length of a stop string", longest, self.max_stop_length, unit=" characters")
        _within("the number of stop_token_ids", len(stop_token_ids), self.max_stop_token_ids)
        _within("the number of logit_bias entries", len(logit_bias or {}), self.max_logit_bias)
        _within("the size of the structured output's grammar", len(grammar.source) if grammar else 0,
                self.max_grammar_size, unit=" characters")

    def check_prompt_tokens(self, num_tokens: int, context: int) -> None:
        _within("prompt tokens", num_tokens, self.max_prompt_tokens or context)


def _within(field: str, value: int, limit: int, unit: str = "") -> None:
    if value > limit:
        raise LimitExceededError(f"{field} is {value}{unit}, over this server's limit of {limit}{unit}")


def check_64_bit_integers(data: Any, path: str = "") -> None:
    """Every integer in a JSON body must fit in 64 bits (the engine and torch store them so)."""
    for where, value in _integers(data, path):
        if not INT64_MIN <= value <= INT64_MAX:
            raise LimitExceededError(f"{where or 'the body'} is {value}, which does not fit in a 64-bit integer")


def _integers(data: Any, path: str) -> Iterator[tuple[str, int]]:
    if isinstance(data, bool):
        return
    if isinstance(data, int):
        yield path, data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _integers(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _integers(value, f"{path}.{i}" if path else str(i))
