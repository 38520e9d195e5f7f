"""The bench's workload: random prompts of token ids, with lengths drawn from ranges."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgen.bench.system import BenchRequest


def random_prompt(rng: np.random.Generator, vocab_size: int, length: int) -> list[int]:
    """Token ids drawn uniformly, skipping ids 0-2 (the usual unk / BOS / EOS slots)."""
    return rng.integers(3, vocab_size, size=length).tolist()


def make_requests(count: int, prompt_range: Sequence[int], output_range: Sequence[int], vocab_size: int,
                  seed: int) -> list[BenchRequest]:
    """`count` requests; lengths uniform in the inclusive ranges, prompt ids random (see random_prompt)."""
    rng = np.random.default_rng(seed)
    lengths = zip(rng.integers(prompt_range[0], prompt_range[1] + 1, count).tolist(),
                  rng.integers(output_range[0], output_range[1] + 1, count).tolist())
    return [BenchRequest(random_prompt(rng, vocab_size, p), o) for p, o in lengths]
