"""How packed layers run many rows of x: on the integer kernel with x in one int8 part where its
build is fast at that (INT8_ISAS), else on the float kernel this CPU runs faster, measured once per
process.

A CPU's bf16 dot products (vdpbf16ps, 32 multiply-adds) may issue at a quarter of its fp32
multiply-adds' rate (16 each), so that fp32 does twice bf16's work a second, or fast enough that
bf16 does more: both were seen on this project's VMs on the same day (BENCHMARKS.md). And oneDNN's
bf16 GEMM runs on AMX where the platform grants it, many times faster than either. So layers that
can run many rows either way (packed ones dequantized per call, coded bf16 ones decoded) time the
two on a prefill-sized matmul once, and take fp32 only when it is clearly the faster.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvgen.model.kernels.bf16 import bf16_kernel
from kvgen.model.kernels.bf16 import pack as pack_bf16
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.f32 import pack as pack_f32

log = logging.getLogger(__name__)

# fp32 must be this much faster to be taken: its weights, laid out per call, are twice the bytes of
# bf16's and cost ~10% of the matmul more to write.
FP32_MARGIN = 1.15
ROWS, IN, OUT = 256, 576, 1152  # the matmul timed: a prompt chunk through a small model's layer
# The integer kernel's builds (kvgen.model.kernels.qmatmul) that run many rows with x in one int8 part
# (as ggml's q8_0 activations, and KQuantLinear) faster than either float kernel on the weight
# dequantized per call: its AVX-512 VNNI build did Q4_0 / Q8_0 layers of a 1B shape (3,072 x 2,048
# to 2,048 x 8,192) at 16 / 64 / 512 rows in 6.1 / 22.7 / 199 ms (Q4_0) and 8.3 / 25.1 / 217 ms (Q8_0)
# of one core where bf16 took 31 / 57 / 407 and 32 / 58 / 402 (AMD EPYC, avx512_bf16, CPU time).
# The AVX2 build (vpmaddubsw, two instructions a product pair) is slower than the float kernels there.
INT8_ISAS = ("avx512-vnni",)


def many_rows_dtype(requested: torch.dtype | None = None, isa: str | None = None) -> torch.dtype | None:
    """The dtype packed layers run many rows in: int8 where requested or, unrequested, where the
    integer kernel's build `isa` is one of INT8_ISAS; else `requested` where its kernel runs here;
    else, where both the bf16 and the fp32 kernel run, bf16 unless fp32 measures faster
    (fp32_beats("bf16 kernel")); else the one that runs; None where neither does."""
    if requested == torch.int8 or (requested is None and isa in INT8_ISAS):
        return torch.int8
    available = [dtype for dtype, kernel in ((torch.bfloat16, bf16_kernel()), (torch.float32, f32_kernel()))
                 if kernel is not None]
    if requested in available or len(available) < 2:
        return requested if requested in available else next(iter(available), None)
    return torch.float32 if fp32_beats("bf16 kernel") else torch.bfloat16


@functools.cache
def fp32_beats(rival: str) -> bool:
    """Whether the fp32 kernel (which must run here) runs the timed matmul FP32_MARGIN times faster
    than `rival`: "bf16 kernel" (kvgen.model.kernels.bf16, which must run here) or "onednn" (bf16
    F.linear); best of 5 alternated runs each, once per process."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(ROWS, IN, generator=generator), torch.randn(OUT, IN, generator=generator)
    xb, wb = x.bfloat16(), w.bfloat16()
    rival_run = (functools.partial(bf16_kernel(), xb, pack_bf16(wb), OUT) if rival == "bf16 kernel"
                 else functools.partial(F.linear, xb, wb))
    runs: dict[str, Callable[[], torch.Tensor]] = {"fp32": functools.partial(f32_kernel(), x, pack_f32(w), OUT),
                                                   rival: rival_run}
    best = dict.fromkeys(runs, math.inf)
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    beats = best["fp32"] * FP32_MARGIN < best[rival]
    log.info("many rows of x: fp32 kernel %.2f ms, %s %.2f ms: %s", best["fp32"] * 1e3, rival, best[rival] * 1e3,
             "fp32" if beats else rival)
    return beats
