"""The batch sizes decode steps are captured at as CUDA graphs, and the padding to them.

A graph replays fixed shapes, so a decode step of n rows runs the graph of the smallest captured
size >= n, its extra rows padding (they write the scratch block and attend to one scratch key; their
outputs are dropped). Sizes: 1, 2, 4, 8, then every 16 up to the largest (as vLLM's and nano-vllm's
ladders: fine steps where small batches are common, every 16 above so padding wastes at most 15
rows). Steps above the largest run eagerly. Plain Python: tested on the CPU.
"""

from __future__ import annotations

import bisect


def ladder(max_batch: int) -> list[int]:
    """The captured sizes for batches up to `max_batch` (its own size the last rung)."""
    if max_batch < 1:
        return []
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The rung a step of `rows` rows replays, or None when it is above the ladder (run eagerly)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


def padding(rows: int, size: int) -> int:
    """Rows of padding a step of `rows` gets on rung `size`."""
    if rows > size:
        raise ValueError(f"{rows} rows do not fit a graph of {size}")
    return size - rows
