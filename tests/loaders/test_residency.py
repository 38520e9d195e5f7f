"""What a loaded process keeps (kvgen.loaders.residency): step buffers kept in the heap
(keep_step_buffers), so that a block freed by one step is reused by the next without faulting its
pages in again; live objects kept out of Python's collections (freeze_live_objects), an unloaded
engine's still freed. Each case runs in a fresh interpreter, since the settings are the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc tuning is Linux's")

# Allocates, writes and frees a 64 MiB block twice (as a step's buffers are) and prints whether the
# thresholds were set and the page faults of the second round.
PROGRAM = """
import resource, sys
import numpy as np
from kvgen.loaders.residency import keep_step_buffers
kept = keep_step_buffers()
def step():
    block = np.empty(64 << 20, dtype=np.uint8)
    block[::4096] = 1
    del block
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

# The fewest faults that bring 64 MiB in: numpy asks for 2 MiB huge pages on blocks this large
# (madvise), which the kernel grants where transparent huge pages are on; 4 KiB pages elsewhere.
LEAST_FAULTS = (64 << 20) // (2 << 20)


def second_step(env: dict[str, str]) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=clean | env, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_step_buffer_is_reused_without_page_faults():
    kept, faults = second_step({})
    assert kept
    assert faults <= 4, f"{faults} page faults on a reused 64 MiB block (at least {LEAST_FAULTS} to fault it in)"


def test_without_it_the_block_faults_in_again():
    """The case above can fail: where the user chose glibc's thresholds, kvgen leaves them, and
    glibc maps and unmaps the block each time."""
    kept, faults = second_step({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert not kept
    assert faults >= LEAST_FAULTS


# Objects in reference cycles (as much of an engine is) alive at freeze_live_objects, then dropped:
# prints whether anything was frozen, whether a plain collection left the first, and whether the next
# freeze_live_objects (after a model's unloading) freed it; the second, frozen at exit, says when the
# interpreter's last collection finalizes it.
FREEZE_PROGRAM = """
import gc, weakref
from kvgen.loaders.residency import freeze_live_objects
class Node:
    def __init__(self, name):
        self.name, self.itself = name, self
    def __del__(self):
        print(self.name, "finalized")
node = Node("unloaded")
ref = weakref.ref(node)
freeze_live_objects()
frozen = gc.get_freeze_count()
del node
gc.collect()
kept = ref() is not None
freeze_live_objects()
print(frozen > 0, kept, ref() is None)
node = Node("alive")
freeze_live_objects()
del node
"""


def test_frozen_objects_are_skipped_by_collections_and_freed_by_the_next_freeze_or_at_exit():
    out = subprocess.run([sys.executable, "-c", FREEZE_PROGRAM], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["unloaded finalized", "True True True", "alive finalized"]
