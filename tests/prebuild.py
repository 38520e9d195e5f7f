"""The suite's cached files, made in a process of its own while a whole-suite run goes on.

On a fresh machine the arch fixtures (tests/loaders/arch_fixtures.py: llama.cpp's converter run twice a
model), the fetched real models and transformers' readings of GGUFs take ~4 minutes of one core, which
the tests would spend waiting for them the first time they are asked for. So `pytest_collection_finish`
(tests/conftest.py) of the first worker starts `python -m tests.prebuild` at a lower priority when a run
collects the whole suite, and ends it with that worker's run: it takes the cores the workers leave
idle. Each file is made under the lock of the code that makes it for a test, so whichever process comes
first makes it and the other waits, then finds it. What fails here is left alone: the test that needs
the file makes it again and reports why it could not.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Fixtures in about the order the suite first asks for them (the first ones it builds itself at once).
ARCHS = ["qwen35", "gemma4", "llama", "qwen2", "qwen3", "phi3", "gemma3", "gpt-oss", "olmoe", "qwen3moe",
         "qwen2moe", "qwen35moe"]
MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"


def steps() -> list[tuple[str, Callable[[], object]]]:
    from tests.loaders.arch_fixtures import arch_checkpoint, with_context
    from tests.support.cached_files import fetch_model, gguf_reading, transformers_saved

    def gemma_reading() -> None:
        gemma = fetch_model(MODELS / "gemma-3-270m" / "fetch.sh", "Gemma 3 270M")
        gguf_reading(gemma)
        transformers_saved(gemma)

    smollm = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return [*((arch, lambda arch=arch: arch_checkpoint(arch)) for arch in ARCHS[:2]),
            ("gemma4 at 1024 positions", lambda: with_context("gemma4", 1024)),
            *((arch, lambda arch=arch: arch_checkpoint(arch)) for arch in ARCHS[2:]),
            ("gemma 3 270M, read by gguf and transformers", gemma_reading),
            ("SmolLM2, read by transformers", lambda: transformers_saved(smollm)),
            ("Qwen2.5-Coder-0.5B", lambda: fetch_model(MODELS / "qwen2.5-coder-0.5b-instruct" / "fetch.sh", "0.5B"))]


def main() -> None:
    os.nice(10)  # the tests come first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ended with the run: temporary files removed
    for name, make in steps():
        started = time.perf_counter()
        try:
            make()
        except Exception as e:  # noqa: BLE001 - the test that needs it makes it again and says why
            print(f"prebuild: {name}: {e}", file=sys.stderr)
            continue
        print(f"prebuild: {name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
