"""Building the C kernels and binding them: compile a source once per machine, check the CPU's
features, bind a library's per-dtype functions, and wrap a bound call for the fused call lists.

A source is compiled with the system's C compiler (`$CC`, else `cc`) and OpenMP into
`$KVGEN_CACHE_DIR/kernels/` (default ~/.cache/kvgen), keyed by the source, the headers beside it, the
flags and the CPU, so each build runs once per machine. `FLAGS` build for the host (-march=native)
without AMX; the matmul kernels pass explicit ISA flags instead and load only where `cpu_has` finds
every feature they use. Where nothing can be built (no compiler, no OpenMP) every caller has a
torch fallback.

    paged_decode.c     decode attention reading K/V in place from the block pool (paged_decode.py)
    paged_store.c      the store of a step's K/V rows into the float pools (paged_decode.py)
    prefill_attention.c  causal attention for a prompt chunk (prefill.py)
    f32_matmul.c, bf16_matmul.c  float linear layers on AVX-512 (f32.py, bf16.py)
    f32_coded.c, bf16_coded.c    the same on losslessly coded weights (coded.py)
    qmatmul.c, kquant.c          packed (quantized) linear layers (qmatmul.py, kquant.py)
    block_pack.c, kquant_pack.c  the packers writing those layouts from a GGUF's blocks
    rms_norm.c, rope.c, step.c   RMSNorm, RoPE, gated activations, residual adds, call lists
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kvgen.paths import cache_root

log = logging.getLogger(__name__)

# The host's ISA, but never AMX: some VMs advertise AMX tiles and trap on their first use (SIGILL).
FLAGS = ("-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-fopenmp", "-shared", "-fPIC")


def dtype_functions(library: ctypes.CDLL, names: dict[torch.dtype, str], argtypes: list,
                    restype) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """A kernel library's per-dtype variants of one function, by dtype, with their C signature set."""
    functions = {}
    for dtype, name in names.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
        functions[dtype] = function
    return functions


class KernelCall:
    """One C kernel call with its arguments bound: a function `int run(const void *args)` (nonzero
    when out of memory) and the struct it is given, for the call lists of kvgen.model.kernels.step,
    which a decode step runs from C with no Python between calls. `keep` holds the tensors the
    struct points into, but for a KV cache's pools (their cache holds them)."""

    def __init__(self, function: ctypes._CFuncPtr, args: ctypes.Structure, keep: tuple = ()) -> None:
        self.address = ctypes.cast(function, ctypes.c_void_p).value
        self.args, self.keep = args, keep


def build_library(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compiles `source` into a shared library in the cache (once per source, the headers beside it,
    flags and CPU); OSError if it cannot."""
    compiler = os.environ.get("CC", "cc")
    texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, compiler, *flags, _cpu_identity()]).encode()).hexdigest()
    target = cache_root() / "kernels" / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
        except FileNotFoundError as e:
            raise OSError(f"no C compiler ({compiler})") from e
        except subprocess.CalledProcessError as e:
            raise OSError(f"{compiler} failed: {e.stderr.strip()[-500:]}") from None
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{compiler} took over {e.timeout} s") from None
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same file
    log.info("built %s", target)
    return target


def cpu_has(features: tuple[str, ...]) -> bool:
    """Whether /proc/cpuinfo lists every one of `features` (False where it cannot be read): kernels
    built with explicit ISA flags load only where the CPU reports them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    present = set(flags.split(":", 1)[1].split())
    return all(feature in present for feature in features)


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
