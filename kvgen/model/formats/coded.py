"""What the coded float layouts share (kvgen.model.kernels.coded): a 4-bit code
for a float's top byte, and the outliers that no code holds.

A float's top byte is its sign and 7 of its 8 exponent bits. In a trained matrix few values of it
occur: with top byte 0 (+0 and the tiniest values) and the 15 most common, each matrix's table holds
all but 0.018% of the weights of the SmolLM2 GGUF here (its Q4_1 values as bf16 or fp32); a window of
16 exponent values held 99.76% of SmolLM2's original bf16 release (BENCHMARKS.md).
Each weight keeps its other bytes and a code; a weight whose top byte has no code (an outlier) is
stored as +0, and the kernels add its product after the rest of its sum.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CODES = 16


@dataclass(frozen=True)
class Outliers:
    """The weights no code holds, by group of rows (a tile or a panel): group g's entries are
    at[start[g]:start[g + 1]], each at column * rows per group + row within the group (encode)."""

    start: torch.Tensor  # int64 [groups + 1]
    at: torch.Tensor  # int32 [outliers]
    value: torch.Tensor  # float32 [outliers]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.start, self.at, self.value))


class OutliersStruct(ctypes.Structure):
    """`struct outliers` of the coded kernels."""

    _fields_ = [("start", ctypes.c_void_p), ("at", ctypes.c_void_p), ("value", ctypes.c_void_p)]

    @classmethod
    def of(cls, outliers: Outliers) -> OutliersStruct:
        return cls(outliers.start.data_ptr(), outliers.at.data_ptr(), outliers.value.data_ptr())


@dataclass(frozen=True)
class CodedWeight:
    """A float matrix [N, K] in a coded layout: `codes` is the layout's bytes (bf16_coded's tiles,
    f32_coded's panels), `table` the top byte of each code (uint8 [16])."""

    codes: torch.Tensor  # uint8
    table: torch.Tensor
    outliers: Outliers
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.table.numel() + self.outliers.nbytes

    def pointers(self) -> tuple[int, int, OutliersStruct]:
        """The codes, the table and the outliers, as the C kernels take them."""
        return self.codes.data_ptr(), self.table.data_ptr(), OutliersStruct.of(self.outliers)


class CodedArgs(ctypes.Structure):
    """`struct coded_args` of coded.h: one call of a coded kernel."""

    _fields_ = [("x", ctypes.c_void_p), ("T", ctypes.c_int64), ("K", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("outliers", OutliersStruct), ("N", ctypes.c_int64),
                ("y", ctypes.c_void_p), ("f32", ctypes.c_int32), ("num_threads", ctypes.c_int32)]

    @classmethod
    def of(cls, x: torch.Tensor, weight: CodedWeight, out: torch.Tensor) -> CodedArgs:
        """y = out [T, N] (contiguous), x [T, K] contiguous."""
        return cls(x.data_ptr(), x.shape[0], x.shape[1], *weight.pointers(), out.shape[1], out.data_ptr(),
                   out.dtype == torch.float32, torch.get_num_threads())


def encode(chunks: list[torch.Tensor], low_bits: int, group_rows: int,
           layout: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], values: torch.Tensor,
           shape: tuple[int, int]) -> CodedWeight:
    """A matrix of `shape`, its weights as int32 bit patterns chunk by chunk ([rows, K] each, in
    order, rows a multiple of `group_rows`, padded rows included), a weight's top byte above its
    `low_bits` other bits -> its CodedWeight: the chunks laid out by `layout(codes, low bits)` and
    concatenated, the outliers by group of `group_rows` rows. `values` [rows, K]: the weights as
    floats, for the outliers' values."""
    table, code_of = _top_byte_codes([chunk >> low_bits & 0xFF for chunk in chunks])
    laid, rows, columns, first = [], [], [], 0
    for chunk in chunks:
        codes, low = code_of[chunk >> low_bits & 0xFF], chunk & ((1 << low_bits) - 1)
        chunk_rows, chunk_columns = (codes < 0).nonzero(as_tuple=True)  # row-major: by group
        codes[chunk_rows, chunk_columns], low[chunk_rows, chunk_columns] = int(code_of[0]), 0  # stored as +0
        rows.append(chunk_rows + first)
        columns.append(chunk_columns)
        laid.append(layout(codes, low))
        first += chunk.shape[0]
    rows, columns = torch.cat(rows), torch.cat(columns)
    start = F.pad(torch.bincount(rows // group_rows, minlength=values.shape[0] // group_rows).cumsum(0), (1, 0))
    outliers = Outliers(start=start.to(torch.int64), at=(columns * group_rows + rows % group_rows).to(torch.int32),
                        value=values[rows, columns].float().contiguous())
    return CodedWeight(codes=torch.cat(laid), table=table, outliers=outliers, shape=shape)


def _top_byte_codes(top_bytes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix's table (uint8 [16]: the top byte of each code) and each top byte's code (int32
    [256], -1 where none), from its top bytes (int32 tensors, chunk by chunk). Top byte 0 always has
    a code: outliers are stored as +0."""
    counts = sum(torch.bincount(chunk.flatten(), minlength=256) for chunk in top_bytes)
    counts[0] = counts.sum() + 1
    table = counts.topk(CODES).indices
    code_of = torch.full((256,), -1, dtype=torch.int32)
    code_of[table] = torch.arange(CODES, dtype=torch.int32)
    return table.to(torch.uint8), code_of
