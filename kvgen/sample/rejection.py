"""Verifying speculative tokens: keep the longest prefix the target would have produced, then one more.

A sequence proposed d_1..d_k; one target pass scored k + 1 rows: row j is the distribution of the
token after d_1..d_j (row 0: after the sequence itself). Each row is adjusted exactly as the sampler
adjusts a lone row (penalties over the history including d_1..d_j, logit bias, temperature, top-k,
top-p, min-p), giving p_j.

    greedy    accept d_{j+1} while it is argmax p_j; the first mismatch is replaced by that argmax
    sampled   accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); on rejection draw from
              norm(max(0, p_j - q_j)) and stop. q_j is the proposer's distribution (a point mass
              for prompt lookup). If all k are accepted, the bonus token is drawn from p_k.

Each emitted token is then distributed exactly as under plain sampling (Leviathan et al., 2023;
Chen et al., 2023), so speculation changes speed, never the output distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.sample.sampler import SamplingRow, TokenLogprobs, apply_penalties, filtered_probs, gather_logprobs
from kvgen.sampling_params import SamplingParams


@dataclass
class Verdict:
    token_ids: list[int]  # the accepted drafts, then the target's own next token
    logprobs: list[TokenLogprobs | None]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class _HistoryRow:
    """A sequence as the sampler sees it at row j of a verify chunk: its output extended by d_1..d_j."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: None = None


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, row: SamplingRow) -> Verdict:
    """logits [k + 1, vocab] fp32 of one verify chunk, draft [k], draft_probs [k, vocab] or None."""
    views = [_HistoryRow(row.params, row.generator, row.prompt_token_ids, row.output_token_ids + draft[:j])
             for j in range(len(draft) + 1)]
    adjusted = apply_penalties(logits, views)
    if row.params.greedy:
        tokens = _accept_greedy(adjusted.argmax(dim=-1).tolist(), draft)
    else:
        probs = filtered_probs(adjusted, [row.params] * len(views)).cpu()  # [k + 1, vocab]
        q = None if draft_probs is None else draft_probs.cpu()
        tokens = _accept_sampled(probs, draft, q, row.generator)
    return Verdict(tokens, gather_logprobs(logits[: len(tokens)], tokens, views[: len(tokens)]))


def _accept_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    for j, token in enumerate(draft):
        if token != argmax[j]:
            return draft[:j] + [argmax[j]]
    return draft + [argmax[len(draft)]]


def _accept_sampled(probs: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """probs [k + 1, vocab] (the target's p_j), q [k, vocab] or None (point masses)."""
    for j, token in enumerate(draft):
        p = probs[j]
        q_token = 1.0 if q is None else float(q[j, token])
        accept = 1.0 if q_token <= 0 else min(1.0, float(p[token]) / q_token)
        if float(torch.rand(1, generator=generator)) < accept:
            continue
        residual = p.clone()
        if q is None:
            residual[token] = 0.0
        else:
            residual = (p - q[j]).clamp(min=0.0)
        if residual.sum() <= 0:  # p <= q everywhere only when p == q, where nothing is rejected
            residual = p
        return draft[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return draft + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))]
