"""Perplexity of a text under each KV cache policy, measured through the engine itself.

The whole text is one prompt with `prompt_logprobs=0` on an engine whose step budget is a single
token, so every token is its own step and is predicted from exactly the K/V its policy kept (a
chunked prefill would let a token see others computed beside it). Perplexity is exp(mean NLL) over
tokens 1..n-1; token 0 (BOS) has nothing to be predicted from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from kvgen.bench.report import Table, machine_info, pyplot, run_info
from kvgen.cache.policies import CachePolicy
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.errors import KVGenError
from kvgen.sample.sampler import TokenLogprobs
from kvgen.sampling_params import SamplingParams
from kvgen.tokenizer import Tokenizer

BUNDLED_TEXT = "tinystory.txt"
# --text-set: one text of each kind, each over 2,000 SmolLM2 tokens (data/README.md: sources, licences)
TEXT_SET = ("gpl-3.0.txt", "python-textwrap.txt", "chat.txt")


@dataclass
class PolicyResult:
    """One policy's run: nll[i] is -log p(token i+1 | what the policy kept of tokens 0..i)."""

    policy: str
    kv_kept: int | None  # the most tokens the policy keeps (None: all)
    nll: list[float]

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))

    def cumulative_perplexity(self) -> list[float]:
        """exp(mean NLL of the first k scored tokens), for k = 1..len(nll)."""
        total, out = 0.0, []
        for k, value in enumerate(self.nll, 1):
            total += value
            out.append(math.exp(total / k))
        return out


def streaming_config(config: EngineConfig) -> EngineConfig:
    """`config` made to stream one token per step. Prefix caching is off as well: tokens served from
    the prefix cache are never computed, so they would get no log-probability."""
    return replace(config, max_num_batched_tokens=1, enable_prefix_caching=False)


def bundled_text(name: str) -> str:
    """A text shipped in kvgen/eval/data."""
    return resources.files("kvgen.eval").joinpath("data", name).read_text(encoding="utf-8")


def read_text(path: Path | None) -> str:
    """The text at `path` (UTF-8), or the bundled story; raises KVGenError if unreadable or empty."""
    if path is None:
        return bundled_text(BUNDLED_TEXT)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise KVGenError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise KVGenError(f"{path}: not UTF-8 text") from None
    if not text.strip():
        raise KVGenError(f"{path}: the text is empty")
    return text


def text_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The text's token ids with BOS first (when the model has one), whatever the tokenizer's habit."""
    token_ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    if bos is not None and token_ids[:1] != [bos]:
        token_ids = [bos] + token_ids
    return token_ids


def default_length(num_tokens: int, policies: list[CachePolicy], max_model_len: int) -> int:
    """Tokens streamed when --max-tokens is not given: the whole text, unless a policy that keeps
    absolute positions (all but sinks) is run: then the context minus the one token the request
    samples. Every policy gets the same length so that their perplexities compare like with like."""
    if all(p.uses_cache_positions for p in policies):
        return num_tokens
    return min(num_tokens, max_model_len - 1)


def evaluate(engine: LLMEngine, token_ids: list[int], specs: list[str]) -> list[PolicyResult]:
    """Streams `token_ids` once per policy, all requests submitted together, and returns each NLL.

    The engine must come from `streaming_config`; the batch-invariant engine gives the same numbers
    as running the policies one after another.
    """
    if engine.config.max_num_batched_tokens != 1 or engine.config.enable_prefix_caching:
        raise ValueError("evaluate() needs an engine built with streaming_config()")
    ids = [f"ppl-{i}" for i in range(len(specs))]
    for request_id, spec in zip(ids, specs):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0, kv_policy=spec)
        engine.add_request(request_id, token_ids, params)
    logprobs: dict[str, list[TokenLogprobs | None]] = {}
    while engine.has_unfinished():
        logprobs.update((out.request_id, out.prompt_logprobs) for out in engine.step() if out.finished)
    return [_result(engine, spec, logprobs[i], len(token_ids)) for i, spec in zip(ids, specs)]


def _result(engine: LLMEngine, spec: str, prompt_logprobs: list[TokenLogprobs | None], num_tokens: int) -> PolicyResult:
    if len(prompt_logprobs) != num_tokens:  # a preempted (recomputed) request scores tokens twice
        raise KVGenError(f"kv_policy {spec}: got {len(prompt_logprobs)} log-probabilities for {num_tokens} tokens "
                         "(was the request preempted? give the KV cache more blocks)")
    policy = engine.resolve_policy(SamplingParams(kv_policy=spec))
    return PolicyResult(spec, policy.max_kept, [-lp.token_logprob for lp in prompt_logprobs[1:]])


def ratios_to_full(results: list[PolicyResult]) -> list[float | None]:
    """Each perplexity over `full`'s (None for all when `full` was not run)."""
    full = next((r.perplexity for r in results if r.policy == "full"), None)
    return [None if full is None else r.perplexity / full for r in results]


def table(results: list[PolicyResult], num_tokens: int) -> str:
    rows = [[r.policy, "all" if r.kv_kept is None else str(r.kv_kept), str(len(r.nll)), f"{r.perplexity:.4f}",
             "-" if ratio is None else f"{ratio:.4f}"]
            for r, ratio in zip(results, ratios_to_full(results))]
    return Table(f"perplexity over {num_tokens} tokens, one token per step",
                 ["policy", "KV kept", "scored", "perplexity", "vs full"], rows).render()


def prefix_perplexity(nll: list[float], num_tokens: int) -> float:
    """Perplexity of the first `num_tokens` tokens (BOS included) of a streamed text. One token per
    step, token i is predicted from tokens 0..i-1 alone, so this is what streaming only those tokens
    gives: one run at the longest length yields every shorter one."""
    scored = nll[:num_tokens - 1]
    return math.exp(sum(scored) / len(scored))


@dataclass
class SweepRow:
    """One cell of `kvgen eval-ppl --text-set`: a text's first `tokens` tokens under one weights
    setting and one KV pool dtype, and the same weights' perplexity with a float32 pool."""

    text: str
    tokens: int
    weights: str        # --quantization
    kv_dtype: str       # the pool's dtype (auto resolved)
    perplexity: float
    reference: float    # the same text, length and weights with a float32 pool

    @property
    def change(self) -> float:
        """Relative change against the float32 pool, in percent."""
        return 100 * (self.perplexity / self.reference - 1)


def sweep_table(rows: list[SweepRow]) -> str:
    cells = [[r.text, str(r.tokens), r.weights, r.kv_dtype, f"{r.perplexity:.4f}",
              "ref" if r.kv_dtype == "float32" else f"{r.change:+.2f}%"] for r in rows]
    return Table("perplexity by KV pool dtype, one token per step (change against the same weights' float32 pool)",
                 ["text", "tokens", "weights", "KV dtype", "perplexity", "vs float32 KV"], cells).render()


def write_sweep_json(path: Path, rows: list[SweepRow], settings: dict, argv: list[str]) -> None:
    """The sweep as `kvgen bench report` reads it (mode kv-perplexity, with the machine and the command)."""
    cells = [{"text": r.text, "tokens": r.tokens, "weights": r.weights, "kv_cache_dtype": r.kv_dtype,
              "perplexity": r.perplexity, "float32_kv_perplexity": r.reference, "change_percent": r.change}
             for r in rows]
    data = {"mode": "kv-perplexity", "settings": settings, "rows": cells, "machine": machine_info(),
            "run": run_info(argv)}
    _write(path, lambda: path.write_text(json.dumps(data, indent=1) + "\n"))


def write_json(path: Path, results: list[PolicyResult], settings: dict) -> None:
    policies = [{"policy": r.policy, "kv_kept": r.kv_kept, "tokens_scored": len(r.nll), "perplexity": r.perplexity,
                 "ratio_to_full": ratio, "nll": r.nll}
                for r, ratio in zip(results, ratios_to_full(results))]
    _write(path, lambda: path.write_text(json.dumps({"settings": settings, "policies": policies}, indent=1) + "\n"))


def plot(path: Path, results: list[PolicyResult], title: str) -> None:
    """Cumulative perplexity against position, one line per policy, a dotted line at each KV budget."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(range(1, len(r.nll) + 1), r.cumulative_perplexity(), label=f"{r.policy}  ({r.perplexity:.3f})")
    for budget in sorted({r.kv_kept for r in results if r.kv_kept is not None}):
        ax.axvline(budget, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"KV budget {budget}", (budget, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set(xlabel="position (tokens scored so far)", ylabel="cumulative perplexity", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(title="policy (final perplexity)")
    fig.tight_layout()
    try:
        _write(path, lambda: fig.savefig(path, dpi=120))
    finally:
        plt.close(fig)


def _write(path: Path, write: Callable[[], object]) -> None:
    try:
        write()
    except OSError as e:
        raise KVGenError(f"{path}: {e.strerror or e}") from None
