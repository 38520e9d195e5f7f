"""Matrix products whose results do not depend on how many rows run together.

A request's tokens must not change with what else is in the batch, and decode at batch 1 must read
the weights at memory speed. On the CPU in fp32 both come from OpenBLAS (through numpy, on the same
memory): its GEMM gives a row the same bits whatever the row count (2 or more), and its GEMV (one
row) runs near memory bandwidth, several times faster than a small GEMM. So each row of a step is
computed by a fixed kernel chosen by the token's role, never by the batch:

    prompt tokens      one GEMM over all of them (padded to 2 rows if alone)
    generated tokens   one GEMV each: their K/V are bit-identical however many decode together,
                       and when a preempted sequence recomputes them

(MKL, torch's default, changes code paths with the row count: 1-3, 5-7 and 9-11 rows round
differently.) Other devices and dtypes use `F.linear` and make no such promise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvgen.threads import WORKERS_SLEEP

# Many GEMV rows over a large matrix (an LM head) go tile by tile so each tile is read from memory
# once and then from cache; a tile's GEMV gives the same bits as the whole matrix's.
GEMV_TILE_BYTES = 4 << 20


def uses_blas(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


@contextmanager
def blas_owns_the_cores(device: torch.device, dtype: torch.dtype, gemv_only: bool) -> Iterator[None]:
    """Runs torch's own ops (attention, norms) on one thread while the model runs on OpenBLAS, when
    that is faster: in GEMV-only steps (decode: memory-bound, OpenBLAS's threads do the reading) and
    whenever idle workers spin (see kvgen.threads), since two spinning pools slow each other down
    many times over. Prefill steps with sleeping workers keep torch's threads for attention."""
    if not uses_blas(device, dtype) or (WORKERS_SLEEP and not gemv_only):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class RowKernels:
    """Rows [gemm) go through one GEMM, rows [gemv) through one GEMV each (two disjoint ranges)."""

    gemm: range
    gemv: range

    @classmethod
    def split(cls, num_rows: int, num_gemv_first: int = 0, num_gemv_last: int = 0) -> "RowKernels":
        """GEMV rows at the front (the engine's decodes) or at the back (generated tokens recomputed)."""
        if num_gemv_first:
            return cls(range(num_gemv_first, num_rows), range(0, num_gemv_first))
        return cls(range(0, num_rows - num_gemv_last), range(num_rows - num_gemv_last, num_rows))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: RowKernels) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out], each row by the kernel `rows` assigns it."""
    if not uses_blas(x.device, x.dtype):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    xn, wt, on = x.numpy(), weight.numpy().T, out.numpy()
    _gemv(xn, wt, on, rows.gemv)
    _gemm(xn, wt, on, rows.gemm)
    return out if bias is None else out.add_(bias)


def _gemv(xn: np.ndarray, wt: np.ndarray, on: np.ndarray, rows: range) -> None:
    tile = wt.shape[1] if len(rows) < 2 else max(1, GEMV_TILE_BYTES // (wt.shape[0] * wt.itemsize))
    for start in range(0, wt.shape[1], tile):
        columns = slice(start, start + tile)
        for r in rows:
            np.matmul(xn[r : r + 1], wt[:, columns], out=on[r : r + 1, columns])


def _gemm(xn: np.ndarray, wt: np.ndarray, on: np.ndarray, rows: range) -> None:
    if len(rows) >= 2:
        np.matmul(xn[rows.start : rows.stop], wt, out=on[rows.start : rows.stop])
    elif len(rows) == 1:  # one row would take the GEMV path: pad to two
        padded = np.zeros((2, xn.shape[1]), dtype=xn.dtype)
        padded[0] = xn[rows.start]
        on[rows.start] = (padded @ wt)[0]
