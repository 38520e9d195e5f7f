"""Soak: the real server under hundreds of mixed requests from the official `openai` client, on
loopback, bounded in count and time. Random lengths and sampling parameters, streams dropped
mid-way, and a few abusive requests. Afterwards no request is lost (each got its full answer or its
error), every KV block is back (the pool invariant holds), and the process's RSS stayed within a
stated bound of what it was after warm-up.

The default suite runs a short soak; `-m slow` runs the long one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import random
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import Server, running

MODEL = "stories260K"
WORDS = "the a cat dog Lily Tom park ball happy sad big little ran jumped saw played with and sun tree".split()
RSS_BOUND = 256 << 20  # bytes the process may grow over its post-warm-up RSS


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if problem:
                self.problems.append(problem)


ABUSIVE = [{"n": 100_000}, {"seed": 2**80}, {"top_k": 10**9}, {"max_tokens": 10**12},
           {"stop": [f"s{i}" for i in range(10_000)]}, {"logit_bias": {str(i): 1 for i in range(5000)}}]


def one_request(client: openai.OpenAI, rng: random.Random, tally: Tally) -> None:
    """A random request; records how it ended ('complete', 'disconnected', 'refused') or what went wrong."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    params = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.7, 1.0, 1.3]),
              "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 2**31),
              "extra_body": {"top_k": rng.choice([0, 20]), "ignore_eos": rng.random() < 0.5}}
    roll = rng.random()
    try:
        if roll < 0.05:
            abusive = rng.choice(ABUSIVE)
            extra_body = {k: v for k, v in abusive.items() if k in ("top_k", "logit_bias")}
            client.completions.create(model=MODEL, prompt=prompt, **{k: v for k, v in abusive.items()
                                                                     if k not in extra_body}, extra_body=extra_body)
            tally.add("lost", f"abusive {list(abusive)} was accepted")
        elif roll < 0.35:
            stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, **params)
            for _ in range(rng.randint(0, 5)):
                next(stream, None)
            stream.close()
            tally.add("disconnected")
        else:
            n = rng.choice([1, 1, 2, 3])
            if rng.random() < 0.5:
                out = client.completions.create(model=MODEL, prompt=prompt, n=n, **params)
                finishes = [c.finish_reason for c in out.choices]
            else:
                chunks = list(client.completions.create(model=MODEL, prompt=prompt, n=n, stream=True, **params))
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            ok = len(finishes) == n and set(finishes) <= {"stop", "length"}
            tally.add("complete" if ok else "lost", None if ok else f"finishes {finishes} for n={n}")
    except openai.BadRequestError as error:
        expected = roll < 0.05
        tally.add("refused" if expected else "lost", None if expected else f"400: {error}")
    except Exception as error:  # noqa: BLE001 - anything else is a lost request
        tally.add("lost", f"{type(error).__name__}: {error}")


def soak(num_requests: int, seconds: float, seed: int) -> tuple[Tally, int, int, Server]:
    """Runs the soak; returns (tally, RSS after warm-up, peak RSS, server)."""
    app = create_app(LLM(num_kv_blocks=256, block_size=8, max_num_seqs=16).engine, model_name=MODEL)
    with running(app) as url:
        server = Server(url, app)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=8)
        start_rss, peak = rss_bytes(), [rss_bytes()]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.05):
                peak[0] = max(peak[0], rss_bytes())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        tally, deadline = Tally(), time.monotonic() + seconds
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(lambda i=i: time.monotonic() < deadline
                                   and one_request(client, random.Random(seed * 100_003 + i), tally))
                       for i in range(num_requests)]
            concurrent.futures.wait(futures)
        done.set()
        watcher.join()
        engine = app.state.kvgen.engine
        settle = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < settle:  # dropped streams abort at the next step
            time.sleep(0.02)
        assert not engine.has_unfinished()
        engine.kv.check_invariants()
        assert engine.kv.num_used_blocks == 0
        client.completions.create(model=MODEL, prompt="still here", max_tokens=4)
        return tally, start_rss, peak[0], server


def check(tally: Tally, num_requests: int, start_rss: int, peak_rss: int) -> None:
    print(f"soak: {dict(tally.outcomes)}, RSS {start_rss >> 20} MiB after warm-up, peak {peak_rss >> 20} MiB")
    assert not tally.problems, tally.problems[:5]
    assert sum(tally.outcomes.values()) == num_requests  # every request ran before the deadline
    assert tally.outcomes["complete"] and tally.outcomes["disconnected"] and tally.outcomes["refused"]
    assert peak_rss - start_rss <= RSS_BOUND


def test_short_soak():
    tally, start, peak, _ = soak(num_requests=80, seconds=120, seed=1)
    check(tally, 80, start, peak)


@pytest.mark.slow
def test_long_soak():
    tally, start, peak, _ = soak(num_requests=600, seconds=900, seed=2)
    check(tally, 600, start, peak)
