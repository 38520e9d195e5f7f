"""The declared option space: every engine and sampling option that changes how a request runs, the
values the pairwise matrix tests (tests/engine/test_option_pairs.py), and the pairs of values the
engine refuses by design, each with the error the user gets.

The value lists come from kvgen.config where it keeps them (KV_CACHE_DTYPES, QUANTIZATION_MODES, ...);
this module only chooses which of them a test runs and says how they may not meet. The table of
refused pairs in docs/options.md is `refused_pairs_markdown()` (a test checks that they agree);
`python -m kvgen.option_space` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.config import (
    ACTIVATION_MODES, ATTENTION_BACKENDS, KV_CACHE_DTYPES, KV_CACHE_MODES, ONE_PROCESS_METHODS, QUANTIZATION_MODES,
    SPECULATIVE_METHODS,
)
from kvgen.cache.policies import FORMS as KV_POLICY_FORMS, KINDS as KV_POLICY_KINDS
from kvgen.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # kvgen.config.DTYPES' canonical names


@dataclass(frozen=True)
class Option:
    """One option: where it is set (an `LLM(...)` / EngineConfig keyword, or a SamplingParams
    field), its CLI flag or API field, every value it takes, and the values the matrix tests."""

    name: str
    where: str  # "engine" or "request"
    flag: str
    values: tuple
    tested: tuple


OPTIONS: tuple[Option, ...] = (
    Option("dtype", "engine", "--dtype", MODEL_DTYPES, ("float32", "bfloat16")),
    Option("quantization", "engine", "--quantization", QUANTIZATION_MODES, QUANTIZATION_MODES),
    Option("kv_cache_dtype", "engine", "--kv-cache-dtype", KV_CACHE_DTYPES, KV_CACHE_DTYPES),
    Option("kv_cache", "engine", "--kv-cache", KV_CACHE_MODES, ("paged", "contiguous")),
    # One instance of each form: windows of 8 tokens, so that short prompts and 24 tokens evict.
    Option("kv_policy", "request", "--kv-policy", KV_POLICY_FORMS, ("full", "window:8", "sinks:2,8", "h2o:4,8")),
    Option("speculative_method", "engine", "--speculative-method", (None, *SPECULATIVE_METHODS), (None, "ngram")),
    Option("grammar", "request", "response_format", (None, *GRAMMAR_KINDS), (None, "json_schema", "regex")),
    Option("n", "request", "n", ("1..",), (1, 2)),
    Option("enable_prefix_caching", "engine", "--no-prefix-caching", (True, False), (True, False)),
    # 4 tokens a step: every prompt is prefilled in chunks; 512 (the default): in one step.
    Option("max_num_batched_tokens", "engine", "--max-num-batched-tokens", ("1..",), (4, 512)),
    Option("fused_decode", "engine", "--no-fused-decode", (True, False), (True, False)),
    Option("attention_backend", "engine", "--attention-backend", ATTENTION_BACKENDS, ("native", "sdpa")),
    Option("tensor_parallel_size", "engine", "--tensor-parallel-size", ("1..",), (1, 2)),
    Option("activations", "engine", "--activations", ACTIVATION_MODES, ACTIVATION_MODES),
)
BY_NAME = {option.name: option for option in OPTIONS}
# What the plain path is: the reference every other combination is compared with.
PLAIN = {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto", "kv_cache": "paged",
         "kv_policy": "full", "speculative_method": None, "grammar": None, "n": 1, "enable_prefix_caching": True,
         "max_num_batched_tokens": 512, "fused_decode": True, "attention_backend": "native",
         "tensor_parallel_size": 1, "activations": "int8x2"}


def kind(name: str, value: object) -> object:
    """What a refusal matches of a value: a kv_policy's form (`sinks:2,8` -> `sinks`), a tensor
    parallel size's `> 1`, else the value itself."""
    if name == "kv_policy":
        return str(value).partition(":")[0]
    if name == "tensor_parallel_size":
        return "> 1" if value > 1 else 1
    return value


@dataclass(frozen=True)
class Refusal:
    """Two options whose values do not meet: `first` = (option, values) with `second` = (option,
    values) raises `error` with `message` in its text, when the engine is built ("engine") or when
    the request is added ("request"). Values are `kind`s."""

    first: tuple[str, tuple]
    second: tuple[str, tuple]
    error: type[Exception]
    message: str
    when: str

    def matches(self, case: dict) -> bool:
        return all(name in case and kind(name, case[name]) in values for name, values in (self.first, self.second))


_LOSSY_POOLS = tuple(d for d in KV_CACHE_DTYPES if d != "auto")
_BOUNDED = tuple(k for k in KV_POLICY_KINDS if k != "full")
REFUSED: tuple[Refusal, ...] = (
    Refusal(("kv_cache", ("contiguous", "none")), ("kv_cache_dtype", _LOSSY_POOLS), ValueError,
            "needs the paged KV cache", "engine"),
    Refusal(("kv_cache", ("contiguous", "none")), ("speculative_method", SPECULATIVE_METHODS), ValueError,
            "speculative decoding needs the paged KV cache", "engine"),
    Refusal(("kv_cache", ("contiguous", "none")), ("tensor_parallel_size", ("> 1",)), ValueError,
            "tensor parallelism needs the paged KV cache", "engine"),
    Refusal(("kv_cache", ("contiguous", "none")), ("kv_policy", _BOUNDED), InvalidRequestError,
            "needs the paged KV cache", "request"),
    Refusal(("speculative_method", SPECULATIVE_METHODS), ("kv_policy", ("sinks", "h2o")), InvalidRequestError,
            "does not compose with speculative decoding", "request"),
    Refusal(("speculative_method", ONE_PROCESS_METHODS), ("tensor_parallel_size", ("> 1",)), ValueError,
            "runs in one process", "engine"),
    Refusal(("tensor_parallel_size", ("> 1",)), ("kv_policy", ("h2o",)), InvalidRequestError,
            "kv_policy h2o is not supported with tensor parallelism", "request"),
    Refusal(("dtype", ("float16",)), ("attention_backend", ("native",)), ValueError,
            "attention_backend 'native' runs on the CPU, for float32 or bfloat16 models", "engine"),
)


def refusal_of(case: dict) -> Refusal | None:
    """The first declared refusal a combination of values meets (engine refusals first: they come
    before any request), or None."""
    hits = [r for r in REFUSED if r.matches(case)]
    return min(hits, key=lambda r: r.when != "engine", default=None)


def refused(first: str, first_value: object, second: str, second_value: object) -> bool:
    """Whether the pair of two options' values is refused by design."""
    return refusal_of({first: first_value, second: second_value}) is not None


def refused_pairs_text() -> str:
    """The refused pairs in a sentence each, for --help."""
    return "; ".join(f"{a} {'|'.join(map(str, av))} with {b} {'|'.join(map(str, bv))}"
                     for (a, av), (b, bv) in ((r.first, r.second) for r in REFUSED))


def _show(values: tuple) -> str:
    return ", ".join("none" if v is None else str(v) for v in values)


def refused_pairs_markdown() -> str:
    """The refused pairs as the table docs/options.md holds."""
    rows = ["| option | values | with option | values | error | when |", "|---|---|---|---|---|---|"]
    for r in REFUSED:
        (a, av), (b, bv) = r.first, r.second
        rows.append(f"| `{a}` | {_show(av)} | `{b}` | {_show(bv)} | {r.error.__name__}: \"...{r.message}...\" "
                    f"| {'building the engine' if r.when == 'engine' else 'adding the request'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(refused_pairs_markdown(), end="")
