"""Where kvgen keeps files it makes for itself: generated benchmark models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KVGEN_CACHE_DIR`, else ~/.cache/kvgen."""
    return Path(os.environ.get("KVGEN_CACHE_DIR") or Path.home() / ".cache" / "kvgen")
