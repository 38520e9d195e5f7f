"""Cache policies: which tokens' K/V a sequence keeps. Pure bookkeeping; the runner applies them.

    full          keep everything (the default)
    window:W      keep the last W tokens (Mistral-style sliding window)
    sinks:S,W     keep the first S tokens ("attention sinks") plus the last W (StreamingLLM)
    h2o:H,W       keep the H tokens with the largest accumulated attention plus the last W (H2O)

Conventions: the query at index t reads key j when j <= t and j is kept; "the last W" means
t - W < j. Positions: full, window and h2o rotate by the token's index in the text, so they are
bounded by the model's context. Sinks rotate by the token's rank inside the cache instead, so RoPE
never sees a position beyond S + W and generation can go on forever in constant memory:

    index:  0 1 2 3 | . . . . . . | 40 41 42 43 44 45 46 47      (S = 4, W = 8, t = 47)
    rank:   0 1 2 3 |   evicted   |  4  5  6  7  8  9 10 11
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.errors import InvalidRequestError

KINDS = ("full", "window", "sinks", "h2o")
FORMS = ("full", "window:W", "sinks:S,W", "h2o:H,W")  # what `kv_policy` accepts, as help and errors show it


@dataclass(frozen=True)
class CachePolicy:
    kind: str = "full"
    window: int | None = None  # the last W tokens are kept (None: no window)
    sinks: int = 0  # the first S tokens are always kept
    heavy: int = 0  # heavy hitters kept besides the window (h2o)

    @classmethod
    def parse(cls, spec: str) -> "CachePolicy":
        """'full', 'window:W', 'sinks:S,W' or 'h2o:H,W' -> a policy; anything else is an invalid request."""
        kind, _, args = spec.strip().partition(":")
        try:
            numbers = [int(a) for a in args.split(",")] if args else []
        except ValueError:
            numbers = None
        arity = {"full": 0, "window": 1, "sinks": 2, "h2o": 2}
        if kind not in arity or numbers is None or len(numbers) != arity[kind] or any(n < 0 for n in numbers):
            raise InvalidRequestError(f"kv_policy {spec!r} is not one of {', '.join(FORMS)} "
                                      "(non-negative integers)")
        if kind in ("window", "sinks", "h2o") and numbers[-1] < 1:
            raise InvalidRequestError(f"kv_policy {spec!r}: the window must keep at least one token")
        if kind == "window":
            return cls("window", window=numbers[0])
        if kind == "sinks":
            return cls("sinks", window=numbers[1], sinks=numbers[0])
        if kind == "h2o":
            return cls("h2o", window=numbers[1], heavy=numbers[0])
        return cls()

    @property
    def spec(self) -> str:
        return {"full": "full", "window": f"window:{self.window}", "sinks": f"sinks:{self.sinks},{self.window}",
                "h2o": f"h2o:{self.heavy},{self.window}"}[self.kind]

    @property
    def max_kept(self) -> int | None:
        """Most tokens whose K/V the policy keeps at once (None: unbounded)."""
        return None if self.window is None else self.sinks + self.heavy + self.window

    @property
    def uses_cache_positions(self) -> bool:
        """Sinks rotate by rank in the cache, so the text may run past the model's context."""
        return self.kind == "sinks"

    @property
    def shares_prefixes(self) -> bool:
        """Whether computed blocks may be reused by other requests: sinks blocks are rotated by rank,
        and h2o decisions depend on attention history that a reused block would not carry."""
        return self.kind in ("full", "window")

    @property
    def prefix_key(self) -> str | None:
        """Extra key of the prefix-cache hash (see `hash_block`). A window changes the K/V of every
        token past the first W in every layer after the first (their hidden states saw fewer tokens),
        so window blocks may only be shared with requests of the same window."""
        return None if self.kind == "full" else self.spec

    @property
    def rope_cap(self) -> int | None:
        """The largest position RoPE gives a token (None: its index, unbounded). Sinks rotate a token
        by its rank in the cache, and the cache never holds more than S + W tokens. The runner caps a
        batch's positions with it; `rope_position` is the same rule for one token."""
        return self.sinks + self.window - 1 if self.uses_cache_positions else None

    def rope_position(self, index: int) -> int:
        """The position RoPE uses for token `index` when it is computed."""
        return index if self.rope_cap is None else min(index, self.rope_cap)

    def max_chunk(self, start: int) -> int | None:
        """Most tokens that may be computed together from `start` (None: no limit).

        Once sinks or h2o start evicting, tokens go one at a time so that what each token sees does
        not depend on how the prompt was chunked (and so on what else ran in the batch).
        """
        if self.kind not in ("sinks", "h2o"):
            return None
        return max(1, self.max_kept - start)

    def dead_range(self, next_index: int) -> tuple[int, int]:
        """[start, end) of tokens no later query reads once token `next_index` is next.

        (For h2o this is only the window rule: heavy hitters are chosen by the runner.)
        """
        if self.window is None or self.kind == "h2o":
            return (0, 0)
        end = next_index - self.window + 1
        return (self.sinks, max(self.sinks, end))
