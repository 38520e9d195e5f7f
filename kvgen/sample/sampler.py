"""Turns a batch of logits into next tokens, each row under its own request's parameters.

Order of operations (as in vLLM / HF): penalties and logit bias on raw logits -> a row's grammar masks the
tokens it does not allow -> greedy rows take the argmax ->
temperature -> top-k -> top-p -> min-p -> softmax -> draw with the request's own generator, so a
seeded request draws the same numbers whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvgen.sample.grammar import GrammarState, mask_logits
from kvgen.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: GrammarState | None


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and of the most likely alternatives (raw model distribution);
    scored prompt tokens also know their rank (1: the most likely token)."""

    token_logprob: float
    top: dict[int, float]
    rank: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless; every per-request state (generator, history) lives on the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [B, vocab] fp32 -> one token per row."""
        raw = logits
        logits = apply_penalties(logits, rows)
        if any(row.grammar is not None for row in rows):
            logits = mask_logits(logits, [row.grammar for row in rows])
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in sampled])
            tokens[index] = draw(probs, [rows[i].generator for i in sampled])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, gather_logprobs(raw, token_ids, rows))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt + output), OpenAI presence/frequency (over output), then
    OpenAI's logit bias (added to the penalized logits)."""
    if not any(row.params.adjusts_logits for row in rows):
        return logits
    logits = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, device=logits.device).unique()
            score = logits[i, seen]
            logits[i, seen] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, device=logits.device),
                                    minlength=logits.shape[-1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, vocab] -> probabilities after temperature, top-k, top-p and min-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        k = torch.tensor([k if k > 0 else logits.shape[-1] for k in top_k], device=device)
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(max=logits.shape[-1] - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if (top_p < 1).any():
        logits = _top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of tokens whose probability mass reaches top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from [B, vocab] probabilities; row i uses generators[i] alone.

    Draws happen on the CPU (where the per-request generators live), so a seed gives the same
    tokens whatever device ran the model."""
    cpu_probs = probs.cpu()
    drawn = torch.cat([torch.multinomial(cpu_probs[i], 1, generator=g) for i, g in enumerate(generators)])
    return drawn.to(probs.device)


def gather_logprobs(raw: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    wanted = [row.params.logprobs for row in rows]
    if all(w is None for w in wanted):
        return [None] * len(rows)
    logprobs = raw.log_softmax(dim=-1)
    return [None if k is None else _token_logprobs(logprobs[i], token_ids[i], k) for i, k in enumerate(wanted)]


def logprobs_of(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """logits [N, vocab] -> the log-probability of token_ids[i] under row i, with `top` alternatives
    and its rank."""
    logprobs = logits.log_softmax(dim=-1)  # [N, vocab]
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])  # [N, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    scored = [_token_logprobs(logprobs[i], t, top) for i, t in enumerate(token_ids)]
    for entry, rank in zip(scored, ranks):
        entry.rank = rank
    return scored


def _token_logprobs(logprobs: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    """logprobs [vocab] -> the chosen token's and the `top` most likely tokens' log-probabilities."""
    best = logprobs.topk(top) if top else None
    alternatives = dict(zip(best.indices.tolist(), best.values.tolist())) if best is not None else {}
    return TokenLogprobs(float(logprobs[token_id]), alternatives)
