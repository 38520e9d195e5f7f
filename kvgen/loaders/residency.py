"""What loading leaves resident in this process: its RSS now and at its peak, handing back the heap,
and zeros that take no memory until written (the KV pools).

Converting a model's matrices to the generic packed format (kvgen.model.linear_choice, gguf_blocks)
allocates and frees large numpy temporaries (the K-quants pack in C, without them). glibc serves
blocks past its mmap threshold with mmap and returns them, but raises that threshold to the largest
block freed (up to 32 MB), so later temporaries come from the heap, whose freed pages it keeps: a
numpy packing pass over a 1B Q4_K_M file leaves ~0.56 GB of freed memory in the RSS, which
`trim_heap` gives back. On other C libraries `trim_heap` does nothing.

A step's buffers are the opposite case: the same few large blocks (a mixture's gathered rows, 33 MB
a layer at 512 tokens on a Qwen3-30B-A3B shape) allocated and freed every layer of every step. Past
the mmap threshold, or at the heap's top past the trim threshold, each comes back from the kernel as
fresh pages that fault in one by one: 8.7% of a 512-token prefill's samples in `perf` on that shape.
`keep_step_buffers`, called once the model is loaded, raises both thresholds so that freed blocks
stay in the heap for the next step: the resident set then holds what one step needs at its peak.

Python's own collector is the third case. A process that loads a model tracks ~200,000-300,000
objects (the tokenizer's and the GGUF's metadata, the model's modules, the libraries'), none of them
garbage, and each full collection walks them all: serving SmolLM2 with suffix speculation, one came
every few requests and took 117-120 ms of one step (a copy task's four 256-token requests ran in
~1.6 s). `freeze_live_objects`, called once the engine is built by the processes that keep it for
their lifetime (`kvgen serve` and its replicas, `kvgen chat`, `kvgen bench`), moves the live
objects out of the collector's sight (`gc.freeze`, as vLLM's engine core does after start-up): that
collection then took 8-9 ms. It thaws and collects first, so that an engine unloaded since the last
call is freed; that collection costs ~0.2 s, once per load.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import math
import mmap
import os
import resource

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """The largest resident set this process has had (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
STEP_BUFFER_LIMIT = 1 << 30  # blocks up to this size, and as much free heap top, stay in the process


def _glibc_function(name: str):
    """A function of the C library if it has it (glibc's malloc tuning), else None."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name, None) if library else None
    except OSError:
        return None


def trim_heap() -> None:
    """Returns the heap's free pages to the system (glibc's malloc_trim; elsewhere nothing)."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


def keep_step_buffers() -> bool:
    """Lets freed blocks up to STEP_BUFFER_LIMIT stay in the heap (glibc's mmap and trim thresholds)
    unless the user set those thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or
    GLIBC_TUNABLES); True where they are set now."""
    mallopt = _glibc_function("mallopt")
    chosen = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys()
    if mallopt is None or chosen or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_BUFFER_LIMIT) and mallopt(_M_TRIM_THRESHOLD, STEP_BUFFER_LIMIT))


def freeze_live_objects() -> None:
    """Collects every object that is garbage now, those frozen before included, then exempts the
    live ones from later collections (see the module docstring) until the interpreter exits: then
    they are thawed, so that its last collection finalizes them (a library's objects left alive at
    exit make it report leaks, as xgrammar's bindings do)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages nothing has written yet: an anonymous private map, which the
    kernel fills with zero pages as they are first written. A KV pool sized for thousands of tokens
    then costs memory as tokens arrive, not at load (torch.zeros writes every page: a 1 GB pool costs
    0.3 s on warm pages and 2-4 s on pages the VM must back afresh, measured on the 1B bench)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages` alive
