"""`kvgen generate --show-kv`: the dashboard's pool picture in a terminal, drawn with rich.

One cell per block (or per bin of blocks, when the pool is larger than the terminal can show),
coloured as on the web page: free, cached prefix, in use (a colour per sequence), shared, released
by a cache policy. Refreshed at most `max_rate` times a second between the engine's steps, so a
person can watch prefill fill blocks, decode append, a window slide and sinks stay. The picture that
stays is the run's last with a sequence in it (its blocks, its policy), never the pool emptied after
it, whose drawing would hang on whether the last step came a redraw interval after the one before.
"""

from __future__ import annotations

import colorsys
import time

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvgen.cache.kv_manager import BLOCK_STATES, USED, BlockStates
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.snapshot import EngineSnapshot, take_snapshot

STYLE = {"free": "grey30", "cached": "#8fb3e8", "shared": "bold white", "released": "bold red"}
CELL = "■"
HOLLOW = "□"  # a cached prefix, as the page draws it
MAX_ROWS = 16


def owner_style(seq_id: int) -> str:
    """The page's colour for a sequence: hue 40..330 by the golden ratio, 62% saturation, 52% lightness."""
    hue = (40 + ((seq_id * 0.6180339887) % 1) * 290) / 360
    r, g, b = colorsys.hls_to_rgb(hue, 0.52, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def bin_size(num_blocks: int, width: int, max_rows: int = MAX_ROWS) -> int:
    return max(1, -(-num_blocks // (width * max_rows)))


def binned(blocks: BlockStates, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(state code, owner) per cell: a bin's most common state (ties go to the higher code: shared and
    used over free) and the first owner among its blocks."""
    codes, owner = blocks.codes, blocks.owner
    if size == 1:
        return codes, owner
    cells = -(-len(codes) // size)
    padded = np.full(cells * size, -1, np.int64)
    padded[: len(codes)] = codes
    tally = np.stack([(padded.reshape(cells, size) == c).sum(axis=1) for c in range(len(BLOCK_STATES))], axis=1)
    best = (len(BLOCK_STATES) - 1) - np.argmax(tally[:, ::-1], axis=1)  # argmax takes the first: the highest code
    owners = np.full(cells * size, -1, np.int64)
    owners[: len(owner)] = owner
    owners = owners.reshape(cells, size)
    first = np.argmax(owners >= 0, axis=1)
    return best.astype(np.int8), owners[np.arange(cells), first]


def render(snap: EngineSnapshot, width: int) -> Group:
    """The picture of one snapshot, `width` cells a row."""
    size = bin_size(snap.num_blocks, width)
    codes, owner = binned(snap.blocks, size)
    grid = Text()
    for i, (code, seq_id) in enumerate(zip(codes.tolist(), owner.tolist())):
        if i and i % width == 0:
            grid.append("\n")
        name = BLOCK_STATES[code]
        grid.append(HOLLOW if name == "cached" else CELL, style=owner_style(seq_id) if code == USED else STYLE[name])
    counts = snap.blocks.counts()
    header = Text(f"KV cache: {snap.num_blocks} blocks x {snap.block_size} tokens"
                  + (f", 1 cell = {size} blocks" if size > 1 else "") + f" · step {snap.step}  ")
    for name, style in (("free", STYLE["free"]), ("cached", STYLE["cached"]), ("used", "green"),
                        ("shared", STYLE["shared"]), ("released", STYLE["released"])):
        header.append(f"{HOLLOW if name == 'cached' else CELL} {name} {counts[name]}  ", style=style)
    lines = [header, grid]
    for s in snap.sequences:
        phase = "decode" if s.phase == "decode" else f"prefill {s.computed_tokens}/{s.prompt_tokens}"
        line = Text(f"{CELL} ", style=owner_style(s.seq_id))
        line.append(f"seq {s.seq_id} {s.status} {phase}, prompt {s.prompt_tokens} + output {s.output_tokens} "
                    f"tokens in {s.num_blocks} blocks, {s.kv_policy}, preempted {s.preemptions}x")
        lines.append(line)
    return Group(*lines)


class KVView:
    """A live terminal view of the engine's pool; call `update()` between steps, `close()` at the end."""

    def __init__(self, engine: LLMEngine, console: Console | None = None, max_rate: float = 10.0) -> None:
        self.engine = engine
        self.console = console or Console()
        self.min_interval = 1.0 / max_rate
        self._shown_at = float("-inf")
        self._shown_step = 0
        self._live = Live(console=self.console, auto_refresh=False)
        self._live.start()

    def update(self, force: bool = False) -> None:
        """Redraws if the last drawing is older than 1 / max_rate seconds (or if forced)."""
        if not force and time.monotonic() - self._shown_at < self.min_interval:
            return
        snap = take_snapshot(self.engine, released_since=self._shown_step)
        if not snap.sequences and self._shown_at > float("-inf") and not force:
            return  # keep the last picture of the run
        width = max(self.console.width - 1, 8)
        self._live.update(render(snap, width), refresh=True)
        self._shown_at, self._shown_step = time.monotonic(), snap.step

    def close(self) -> None:
        """Stops redrawing; the last picture stays on screen."""
        self._live.stop()
