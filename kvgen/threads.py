"""Thread pools: torch's OpenMP pool (which kvgen's kernels share) and OpenBLAS's (see
kvgen.model.linear) share the cores.

Workers that spin long after each parallel region (libgomp's default is ~3 ms) steal the core the
other pool needs next, which makes small matmuls many times slower. Workers that sleep at once
(OMP_WAIT_POLICY=PASSIVE alone) cost a wake-up of the second thread at every kernel call instead:
~35 us here, 121 times in a decode step, a third of a Q4_1 step. So OpenMP's workers spin for a
short while (GOMP_SPINCOUNT=30000, ~0.3 ms: longer than the gap between a step's kernels, shorter
than the gaps between OpenBLAS's GEMMs in a prefill), then sleep; OpenBLAS's sleep at once. The
libraries read these settings when they load, so they only hold when kvgen is imported before
torch and numpy (the CLI always is). `WORKERS_SLEEP` records whether they hold; if not, steps that
run OpenBLAS keep torch to one thread.
"""

import os
import sys

_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000", "OPENBLAS_THREAD_TIMEOUT": "4"}
_already_set = all(os.environ.get(k, "").upper() == v for k, v in _SETTINGS.items())
_libraries_loaded = "torch" in sys.modules or "numpy" in sys.modules
_ADDED = frozenset(k for k in _SETTINGS if k not in os.environ)  # the settings the user did not make
for _key, _value in _SETTINGS.items():
    os.environ.setdefault(_key, _value)
WORKERS_SLEEP = _already_set or not _libraries_loaded


def foreign_environment() -> dict[str, str]:
    """The environment for another program (a benchmark peer's server): kvgen's own settings taken
    out again, so that it runs with its defaults. Passed on, OMP_WAIT_POLICY=PASSIVE alone cut
    llama.cpp's Q4_1 decode here from 135 to 38 tok/s (llama-bench, BENCHMARKS.md)."""
    return {k: v for k, v in os.environ.items() if k not in _ADDED}
