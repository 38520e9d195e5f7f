"""Per-request sampling parameters, validated on construction (bad values raise InvalidRequestError)."""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field

from kvgen.cache.policies import CachePolicy
from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import GrammarSpec


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. Defaults follow vLLM / the OpenAI API.

    temperature 0 (below 1e-5) means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch those filters off.
    With n > 1 and a seed, completion i uses seed + i, so each equals a separate run with that seed.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    kv_policy: str = "full"
    grammar: GrammarSpec | None = None  # structured output: what the completion must match
    # Speculative decoding on an engine that has it: None follows the engine, False opts out,
    # True insists (refused by an engine without speculation).
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name in _FLOAT_FIELDS:  # a string or None would otherwise fail with a TypeError below
            value = getattr(self, name)
            _check(_is_number(value) and not math.isnan(value), f"{name} must be a number, got {value!r}")
        _check(_is_int(self.n) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature}")
        _check(_is_int(self.top_k), f"top_k must be an integer, got {self.top_k!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1),
               f"seed must fit in a signed 64-bit integer (with seed + n - 1), got {self.seed}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, (list, tuple, set, frozenset))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be in [0, 20], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")
        if self.logit_bias is None:
            self.logit_bias = {}
        _check(isinstance(self.logit_bias, dict)
               and all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100
                       for t, b in self.logit_bias.items()),
               "logit_bias must map token ids to biases in [-100, 100]")
        _check(isinstance(self.kv_policy, str), f"kv_policy must be a string, got {self.kv_policy!r}")
        self._policy = (self.kv_policy, CachePolicy.parse(self.kv_policy))  # (its spec, the policy)
        _check(self.grammar is None or isinstance(self.grammar, GrammarSpec),
               f"grammar must be a GrammarSpec, got {self.grammar!r}")
        _check(self.speculative is None or isinstance(self.speculative, bool),
               f"speculative must be true, false or null, got {self.speculative!r}")

    @property
    def cache_policy(self) -> CachePolicy:
        """`kv_policy` parsed, once, when these parameters were made (again only if it was reassigned)."""
        if self._policy[0] != self.kv_policy:
            self._policy = (self.kv_policy, CachePolicy.parse(self.kv_policy))
        return self._policy[1]

    @property
    def greedy(self) -> bool:
        # As in vLLM, a temperature this small is greedy: dividing logits by it would overflow to inf.
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before any token is chosen."""
        return self.has_penalties or bool(self.logit_bias)

    def for_completion(self, index: int) -> "SamplingParams":
        """The parameters of completion `index` of an n > 1 request (its own seed). A shallow copy, as
        `dataclasses.replace` would make, without validating (and parsing kv_policy) again: n = 1 and
        seed + index were checked with these parameters."""
        completion = copy.copy(self)
        completion.n, completion.seed = 1, None if self.seed is None else self.seed + index
        return completion


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
