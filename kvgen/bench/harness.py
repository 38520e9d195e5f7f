"""The peer harness: `benchmarks/` at the root of a kvgen checkout, reached from `kvgen bench` here only.

kvgen's own measurements (latency, throughput, scaling, memory, serve, replicas) need nothing from
it. What drives other engines and llama.cpp's tools lives there, outside the package, since a user
of kvgen installs none of them: the peers of `--compare` (benchmarks.peers, benchmarks.llama_server),
the generated models of `--model smollm2-135m` or `llama-1b:Q4_K_M` (benchmarks.models,
benchmarks.random_models, benchmarks.llama_tools) and the page of `kvgen bench report`
(benchmarks.page). It is imported as the package `benchmarks`: from sys.path where it is already
there (a checkout's root, where the tests and `python -m kvgen` run), else from beside the kvgen
package this process imported (an editable install of a checkout). An installed kvgen without a
checkout gets one line saying so (exit 2), and its bench runs on model files without peers.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from kvgen.errors import KVGenError

CHECKOUT = Path(__file__).resolve().parents[2]


class HarnessMissing(KVGenError, ValueError):
    """`benchmarks/` is not beside this kvgen: it runs from an installed package, not a checkout."""


def available() -> bool:
    try:
        _import("benchmarks")
    except HarnessMissing:
        return False
    return True


def harness(module: str, wanted_for: str) -> ModuleType:
    """`benchmarks.<module>`; raises HarnessMissing, naming `wanted_for`, where there is no checkout."""
    try:
        return _import(f"benchmarks.{module}")
    except HarnessMissing:
        raise HarnessMissing(f"{wanted_for} needs the peer harness, benchmarks/ in a kvgen checkout (not beside "
                             f"{CHECKOUT / 'kvgen'}): git clone kvgen and pip install -e '.[bench]'") from None


def _import(name: str) -> ModuleType:
    try:
        importlib.import_module("benchmarks")
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        if not (CHECKOUT / "benchmarks" / "__init__.py").is_file():
            raise HarnessMissing(name) from None
        sys.path.append(str(CHECKOUT))
    return importlib.import_module(name)
