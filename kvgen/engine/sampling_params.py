"""Per-request sampling parameters, validated on construction (bad values raise InvalidRequestError)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgen.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. Defaults follow vLLM / the OpenAI API.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch those filters off.
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
    kv_policy: str = "full"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int), f"top_k must be an integer, got {self.top_k!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def for_completion(self, index: int) -> "SamplingParams":
        """The parameters of completion `index` of an n > 1 request (its own seed)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
