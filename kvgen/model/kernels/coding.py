"""What the coded float layouts share (kernels/bf16_coded.py, kernels/f32_coded.py): a 4-bit code
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CODES = 16


@dataclass(frozen=True)
class Outliers:
    """The weights no code holds, by group of rows (a tile or a panel): group g's entries are
    at[start[g]:start[g + 1]]; an entry's position within its group is the layout's to say."""

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


def top_byte_codes(top_bytes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix's table (uint8 [16]: the top byte of each code) and each top byte's code (int32
    [256], -1 where none), from its top bytes (int32 tensors, chunk by chunk). Top byte 0 always has
    a code: outliers are stored as +0."""
    counts = sum(torch.bincount(chunk.flatten(), minlength=256) for chunk in top_bytes)
    counts[0] = counts.sum() + 1
    table = counts.topk(CODES).indices
    code_of = torch.full((256,), -1, dtype=torch.int32)
    code_of[table] = torch.arange(CODES, dtype=torch.int32)
    return table.to(torch.uint8), code_of


def take_outliers(codes: torch.Tensor, code_of: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Where `codes` [rows, K] is -1: the positions (rows, columns), after setting those codes to
    top byte 0's and the same positions of `others` (the weights' other bytes) to 0."""
    rows, columns = (codes < 0).nonzero(as_tuple=True)  # row-major: by group, as Outliers wants them
    codes[rows, columns] = int(code_of[0])
    for other in others:
        other[rows, columns] = 0
    return rows, columns


def outliers_by_group(rows: torch.Tensor, at: torch.Tensor, values: torch.Tensor, group_rows: int,
                      groups: int) -> Outliers:
    """Outliers (their rows, in row-major order, their positions within a group and their values),
    grouped by `group_rows` rows."""
    start = F.pad(torch.bincount(rows // group_rows, minlength=groups).cumsum(0), (1, 0))
    return Outliers(start=start.to(torch.int64), at=at.to(torch.int32), value=values.float().contiguous())
