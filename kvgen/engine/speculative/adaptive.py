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
              show); now and then a step of a bucket takes the other one (a probe), so a change in
              acceptance (a text that stops repeating its input) is noticed. Probes come every
              PROBE_EVERY steps at first and half as often after each one that leaves the choice
              standing (down to one in MAX_PROBE_EVERY); a probe that beats the choice is followed
              by another at once, and a choice that flips starts over. A request that starts alone
              (batch 1) brings a new text, so there plain decoding's choice is probed at its first
              decode step (one verify step per request where speculation loses). A probe at
              batch 64 costs several plain steps, and with fixed probes a throughput run lost ~7%
              against plain decoding once plain steps had got faster.
    guesses   while plain decoding is the choice, a model-free proposer (suffix, ngram) still names
              the token it would propose first, for the cost of a lookup (in steps of up to 4
              sequences); GUESS_STREAK plain steps in a row whose tokens it named (every sequence's)
              probe speculation at the next step: an edit's reply that returns to copying its input
              after the changed lines is noticed within a few tokens, not after PROBE_EVERY steps or
              more. A streak's probe that loses doubles the streak asked next time (up to
              MAX_GUESS_STREAK); one that wins resets it.
    cost      a probe of the losing arm costs what its step takes beyond what the winner would have
              taken for the same tokens; the gap between probes is at least that cost over
              PROBE_BUDGET of the winner's step time, so probing costs at most ~2% of the time. On
              a packed model (SmolLM2 Q4_1, int8x2 activations) a step verifying K + 1 = 7 tokens
              takes several plain steps; on free text it keeps one token, so probing every 32 steps
              lost ~10%.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 3
MARGIN = 1.1  # in a batch, speculation must emit 10% more tokens per second than plain decoding
PROBE_EVERY = 32
MAX_PROBE_EVERY = 8 * PROBE_EVERY
WINDOW = 9  # rates an arm remembers
PROBE_BUDGET = 0.02  # share of the winner's step time that probing the loser may cost
MAX_BUDGET_PROBE_EVERY = 4 * MAX_PROBE_EVERY  # a change of text is still noticed within ~1,000 steps
GUESS_STREAK = 3  # plain steps in a row whose tokens the proposer guessed, before a probe
MAX_GUESS_STREAK = 48


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

    def mean_step(self) -> tuple[float, float]:
        """(tokens, seconds) of a typical remembered step: the means."""
        count = max(len(self.recent), 1)
        return sum(t for t, _ in self.recent) / count, sum(s for _, s in self.recent) / count


def probe_gap(best: _Arm, other: _Arm) -> int:
    """Steps between probes of `other` that keep their cost within PROBE_BUDGET of the time: a
    probe emits `other`'s tokens of a step in its seconds, which `best` would emit in tokens / rate."""
    tokens, seconds = other.mean_step()
    _, best_seconds = best.mean_step()
    extra = seconds - tokens / best.rate if best.rate > 0 else 0.0
    if extra <= 0 or best_seconds <= 0:
        return PROBE_EVERY
    return min(max(PROBE_EVERY, int(extra / (PROBE_BUDGET * best_seconds)) + 1), MAX_BUDGET_PROBE_EVERY)


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    decisions: int = 0
    choice: bool | None = None  # the faster arm at the last decision
    probe_every: int = PROBE_EVERY
    next_probe: int = PROBE_EVERY  # the decision that probes the other arm
    guessed: int = 0  # plain steps in a row whose tokens the proposer guessed
    streak: int = GUESS_STREAK  # how many of them probe speculation
    streak_probe: bool = False  # the pending probe came from a streak

    def decide(self, best: bool) -> bool:
        """The arm for this step, given the faster one: `best`, or the other on a probe."""
        gap = probe_gap(self.arms[best], self.arms[not best])
        if best != self.choice:  # a new choice: probe it soon, as soon as its cost allows
            self.choice, self.probe_every = best, PROBE_EVERY
            self.next_probe = self.decisions + gap
        if self.decisions < self.next_probe:
            return best
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self.next_probe = self.decisions + max(self.probe_every, gap)
        return not best

    def after_probe(self, won: bool) -> None:
        """A probe that beat the standing choice's rate is followed by another at once, until the
        choice flips or a probe loses."""
        if won:
            self.probe_every, self.next_probe = PROBE_EVERY, self.decisions + 1
        if self.streak_probe:
            self.streak = GUESS_STREAK if won else min(2 * self.streak, MAX_GUESS_STREAK)
            self.streak_probe = False

    def guess_checked(self, hit: bool) -> None:
        """A plain step's tokens were (hit) or were not all the proposer's guesses."""
        self.guessed = self.guessed + 1 if hit and self.choice is False else 0
        if self.guessed >= self.streak:
            self.guessed, self.streak_probe, self.next_probe = 0, True, self.decisions + 1


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
        return bucket.decide(on.rate >= (MARGIN if batch_size > 1 else 1.0) * off.rate)  # alone, nothing waits

    def new_request(self) -> None:
        """A request starts alone: its text may repeat its prompt where the last one's did not (on the
        bench's copy task the last one's ending turned speculation off, and the next request ran
        plainly for 64 steps until the probe), so a choice of plain is probed at the next decision."""
        bucket = self._buckets.get(1)
        if bucket is not None and bucket.choice is False:
            bucket.probe_every, bucket.next_probe = PROBE_EVERY, bucket.decisions + 1

    def guess_checked(self, batch_size: int, hit: bool) -> None:
        """A plain step of `batch_size` sequences emitted the tokens a model-free proposer guessed for
        each of them (hit), or not."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is not None:
            bucket.guess_checked(hit)

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` sequences emitted `tokens` in `seconds`."""
        if seconds <= 0:
            return
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        if bucket.choice is not None and speculated != bucket.choice:
            bucket.after_probe(tokens / seconds > bucket.arms[bucket.choice].rate)
        bucket.arms[speculated].add(tokens, seconds)

    def table(self) -> dict[str, dict[str, float]]:
        """Batch-size bucket -> measured tokens/s of each arm (for logs and the docs' examples)."""
        table = {}
        for bits, bucket in sorted(self._buckets.items()):
            arms = bucket.arms
            table[f"{1 << (bits - 1)}-{(1 << bits) - 1}"] = {"speculate": arms[True].rate, "plain": arms[False].rate}
        return table
