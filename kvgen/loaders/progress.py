"""How far loading has got: a progress bar over the bytes of a model's weights as they are converted.

Loading a GGUF is mostly converting each matrix to its kernel's layout (kvgen.model.linear_choice; in C
for the K-quants, ~0.4 s for a 1B Q4_K_M file, more where the VM backs the new pages afresh).
`loading(total, label)` opens a bar for the `with` block; whatever converts a weight calls
`advance(nbytes)`, which does nothing outside such a block (library use, tests, workers).

The bar goes to stderr, only when stderr is a terminal (a log or a pipe gets no carriage-return
noise), and only once loading has taken a second (tqdm's `delay`): small models never show it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

SHOW_AFTER_S = 1.0
_bar: ContextVar[object | None] = ContextVar("kvgen_load_progress", default=None)


@contextmanager
def loading(total: int, label: str = "loading weights") -> Iterator[None]:
    """A progress bar over `total` bytes for the duration of the block (see the module docstring)."""
    if not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, delay=SHOW_AFTER_S, file=sys.stderr, leave=False)
    token = _bar.set(bar)
    try:
        yield
    finally:
        _bar.reset(token)
        bar.close()


def advance(nbytes: int) -> None:
    """`nbytes` more of the weights are converted."""
    bar = _bar.get()
    if bar is not None:
        bar.update(nbytes)
