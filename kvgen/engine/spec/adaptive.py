"""When to speculate: measured, per batch size.

At batch 1 a step reads every weight once whatever number of tokens it verifies, so K + 1 tokens cost
about as much as one and every accepted token is nearly free. As the batch grows the step becomes
compute-bound: verifying K + 1 tokens per sequence costs up to K + 1 times as much, and only pays if
enough are accepted. Which side of that line a batch is on depends on the machine, the model, the
proposer and the text, so it is measured rather than modelled:

    bucket    batch sizes 1, 2-3, 4-7, 8-15, ... (by bit length)
    arms      speculate / not, each with its rate over its last WINDOW decode-only steps: tokens
              emitted / seconds of step time (the draft's proposing included), leaving out the
              slowest step (on a shared machine a step now and then takes many times its usual time)
    choice    each arm is tried MIN_SAMPLES times, then the faster one is taken (in a batch,
              speculation only when it measures MARGIN faster: its steps also take K + 1 tokens of
              a step's budget from the other sequences' prefills, which decode-only steps do not
              show); every
              PROBE_EVERY-th step of a bucket takes the other one, so a change in acceptance (a text
              that stops repeating its input) is noticed
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 3
MARGIN = 1.1  # in a batch, speculation must emit 10% more tokens per second than plain decoding
PROBE_EVERY = 32
WINDOW = 9  # rates an arm remembers


@dataclass
class _Arm:
    """Throughput as a ratio of sums, not a typical step's rate: speculating at batch 1 yields K + 1
    tokens in some steps and 1 in others (a request's first steps, before its text repeats its
    input), and a median of per-step rates then ranks it below plain decoding at 3-4x its speed."""

    samples: int = 0
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, seconds)

    @property
    def rate(self) -> float:
        """Tokens per second over the remembered steps, the slowest left out once there are three."""
        steps = sorted(self.recent, key=lambda step: step[1])[: -1 if len(self.recent) >= 3 else None]
        seconds = sum(s for _, s in steps)
        return sum(t for t, _ in steps) / seconds if seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, seconds))
        self.samples += 1


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    decisions: int = 0


class AdaptiveSwitch:
    """Per step: speculate or not, for a step with `batch_size` running sequences."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def decide(self, batch_size: int) -> bool:
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        bucket.decisions += 1
        on, off = bucket.arms[True], bucket.arms[False]
        if min(on.samples, off.samples) < MIN_SAMPLES:
            return on.samples <= off.samples
        best = on.rate >= (MARGIN if batch_size > 1 else 1.0) * off.rate  # alone, nothing else waits on it
        return (not best) if bucket.decisions % PROBE_EVERY == 0 else best

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` sequences emitted `tokens` in `seconds`."""
        if seconds > 0:
            self._buckets.setdefault(batch_size.bit_length(), _Bucket()).arms[speculated].add(tokens, seconds)

    def table(self) -> dict[str, dict[str, float]]:
        """Batch-size bucket -> measured tokens/s of each arm (for logs and the docs' examples)."""
        table = {}
        for bits, bucket in sorted(self._buckets.items()):
            arms = bucket.arms
            table[f"{1 << (bits - 1)}-{(1 << bits) - 1}"] = {"speculate": arms[True].rate, "plain": arms[False].rate}
        return table
