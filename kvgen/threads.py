"""Thread pools: torch's OpenMP pool and OpenBLAS's (see kvgen.model.linear) share the cores.

Workers that spin after each parallel region steal the core the other pool needs next, which makes
small matmuls many times slower. Sleeping workers avoid it, but the libraries read these settings
when they load, so they only hold when kvgen is imported before torch and numpy (the CLI always
is). `WORKERS_SLEEP` records whether they hold; if not, steps keep torch to one thread.
"""

import os
import sys

_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
_already_set = all(os.environ.get(k, "").upper() == v for k, v in _SETTINGS.items())
_libraries_loaded = "torch" in sys.modules or "numpy" in sys.modules
for _key, _value in _SETTINGS.items():
    os.environ.setdefault(_key, _value)
WORKERS_SLEEP = _already_set or not _libraries_loaded
