"""Which float kernel this CPU runs many rows of x faster on, from how many rows packed layers
leave the integer kernel for it, and whether prefill-sized calls go to oneDNN's GEMM instead,
measured once per process.

A CPU's bf16 dot products (vdpbf16ps, 32 multiply-adds) may issue at a quarter of its fp32
multiply-adds' rate (16 each), so that fp32 does twice bf16's work a second, or fast enough that
bf16 does more: both were seen on this project's VMs on the same day (BENCHMARKS.md). And oneDNN's
bf16 GEMM runs on AMX where the platform grants it, many times faster than either. So layers that
can run many rows either way (packed ones dequantized per call, coded bf16 ones decoded) time the
two on a prefill-sized matmul once, and take fp32 only when it is clearly the faster. Packed layers
also time their own many-rows path against the weight dequantized to row-major bf16 for oneDNN
(onednn_beats): on an Intel Xeon with AMX, oneDNN's GEMM ran a 2,048 x 8,192 Q8_0 layer's 512 rows
about 5x faster than the bf16 kernel (dequantizing included), and a Q4_K layer's 2-3x faster than
the K-quant kernel; where it does not win, as on CPUs without AMX, nothing changes.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType

from kvgen.model.kernels.bf16 import bf16_kernel
from kvgen.model.kernels.bf16 import pack as pack_bf16
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.f32 import pack as pack_f32
from kvgen.model.kernels.kquant import kquant_kernel
from kvgen.model.kernels.qmatmul import qmatmul_kernel
from kvgen.model.formats.float_weights import quantize_int4

log = logging.getLogger(__name__)

# oneDNN must be this much faster than a packed layer's own many-rows path to be taken.
ONEDNN_MARGIN = 1.15
# fp32 must be this much faster to be taken: its weights, laid out per call, are twice the bytes of
# bf16's and cost ~10% of the matmul more to write.
FP32_MARGIN = 1.15
ROWS, IN, OUT = 256, 576, 1152  # the matmul timed: a prompt chunk through a small model's layer
# Below this many rows, where the integer kernel beats the float path at INTEGER_ROWS rows
# (integer_beats), packed layers keep the integer kernel with their own activations. On an AMD EPYC
# (Zen 4) the integer kernel (x int8x2) ran 1B-shaped Q4_0 layers (3,072 x 2,048 to 2,048 x 8,192) at
# 16 / 64 rows in 11.8 / 47.9 ms of one core where dequantizing to bf16 took 31.2 / 57.4, both near
# 100 ms at ~128 and bf16 ahead beyond (407 against 437 ms at 512); where the 16-row threshold was
# measured, bf16 ran 1.3-1.9x faster than the integer kernel at 16 rows. Where the integer kernel
# with the layer's activations wins by PREFILL_MARGIN at PREFILL_ROWS too, the layers never leave it:
# on an AMD EPYC (Zen 5, 2 threads) the llama-1b shape's 32 Q4_0 MLP matrices took 490 ms at 512
# rows with x in one int8 part against 1,172 dequantized to bf16 (1,384 to fp32), where x in two
# parts took 1,116, level with bf16.
INTEGER_BELOW_ROWS, INTEGER_ROWS, PREFILL_ROWS = 128, 64, 256
PREFILL_MARGIN = 1.2  # more than a noisy start-up timing swings


def many_rows_dtype(requested: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype packed layers run many rows in: `requested` where its kernel runs here; else, where
    both the bf16 and the fp32 kernel run, bf16 unless fp32 measures faster (fp32_beats("bf16
    kernel")); else the one that runs; None where neither does."""
    available = [dtype for dtype, kernel in ((torch.bfloat16, bf16_kernel()), (torch.float32, f32_kernel()))
                 if kernel is not None]
    if requested in available or len(available) < 2:
        return requested if requested in available else next(iter(available), None)
    return torch.float32 if fp32_beats("bf16 kernel") else torch.bfloat16


def best_times(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each run's best wall time in seconds over 5 rounds, the runs alternated within each round so
    that a drift of the machine falls on all of them."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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
    best = best_times(runs)
    beats = best["fp32"] * FP32_MARGIN < best[rival]
    log.info("many rows of x: fp32 kernel %.2f ms, %s %.2f ms: %s", best["fp32"] * 1e3, rival, best[rival] * 1e3,
             "fp32" if beats else rival)
    return beats


@functools.cache
def integer_beats(dtype: torch.dtype, rows: int = INTEGER_ROWS, activations: str = "int8x2",
                  margin: float = 1.0) -> bool:
    """Whether the integer kernel (which must run here; x quantized as `activations` says) runs
    `rows` rows through a packed int4 matrix `margin` times faster than dequantizing it per call for
    the `dtype` kernel (which must run here) and running that; best of 5 alternated runs each, once
    per process."""
    generator = torch.Generator().manual_seed(0)
    w = quantize_int4(torch.randn(OUT, IN, generator=generator))
    x = torch.randn(rows, IN, generator=generator)
    bound, xb = qmatmul_kernel().bind(w, activations), x.bfloat16()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "integer": functools.partial(bound.run, x),
        "float": (lambda: bf16_kernel()(xb, bound.dequantize_bf16(), OUT, torch.float32)) if dtype == torch.bfloat16
        else (lambda: f32_kernel()(x, bound.dequantize_f32(), OUT))}
    best = best_times(runs)
    log.info("%d rows of x: integer kernel (x %s) %.2f ms, dequantized %s %.2f ms", rows, activations,
             best["integer"] * 1e3, dtype, best["float"] * 1e3)
    return best["integer"] * margin < best["float"]


@functools.cache
def onednn_beats(rival: str) -> bool:
    """Whether dequantizing a packed weight to row-major bf16 and running oneDNN's GEMM (which takes
    AMX where the platform grants it) runs ROWS rows ONEDNN_MARGIN times faster than `rival`, the
    packed layer's own path (which must run here): "bf16 kernel" or "fp32 kernel" (an int4 weight
    dequantized per call for that kernel), "integer kernel" (an int4 weight, x in one int8 part) or
    "K-quant kernel" (a Q4_K weight, x in one int8 part).
    Best of 5 alternated runs each, once per process."""
    generator = torch.Generator().manual_seed(0)
    cols = IN // 256 * 256 if rival == "K-quant kernel" else IN  # whole super-blocks
    x = torch.randn(ROWS, cols, generator=generator)
    xb = x.bfloat16()
    if rival == "K-quant kernel":
        kernel = kquant_kernel()
        bound = kernel.bind(kernel.pack(GGMLQuantizationType.Q4_K, [_q4_k_blocks(OUT, cols)]), 1)
        rival_run: Callable[[], object] = functools.partial(bound.run, x)
    else:
        bound = qmatmul_kernel().bind(quantize_int4(torch.randn(OUT, IN, generator=generator)), "int8")
        rival_run = ((lambda: bf16_kernel()(xb, bound.dequantize_bf16(), OUT, torch.float32)) if rival == "bf16 kernel"
                     else (lambda: f32_kernel()(x, bound.dequantize_f32(), OUT)) if rival == "fp32 kernel"
                     else functools.partial(bound.run, x))
    best = best_times({"onednn": lambda: F.linear(xb, bound.dequantize_bf16_rows()), rival: rival_run})
    beats = best["onednn"] * ONEDNN_MARGIN < best[rival]
    log.info("%d rows of x: oneDNN on the weight dequantized %.2f ms, %s %.2f ms: %s", ROWS, best["onednn"] * 1e3,
             rival, best[rival] * 1e3, "oneDNN" if beats else rival)
    return beats


def _q4_k_blocks(out: int, cols: int) -> np.ndarray:
    """uint8 [out, bytes per row]: random Q4_K blocks (any codes and sub-block scales) with small
    finite super-block scales, a matrix to time."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (out, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.full((out, cols // 256, 2), 0.01, dtype=np.float16).view(np.uint8)  # d, dmin
    return blocks.reshape(out, -1)
