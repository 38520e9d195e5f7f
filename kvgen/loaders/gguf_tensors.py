"""GGUF tensors as raw blocks: what a quantized linear layer needs, and their float values for everyone else.

A GGUF tensor of a block type (Q8_0, Q4_K, ...) stores each row as consecutive blocks of 32 or 256
weights with their scales. `GGUFWeight` keeps those bytes untouched, one row of blocks per output
row, so that a kernel can read them in place; `dequantize()` gives the float values, with `gguf`'s
own dequantizers (the reference for every type). Because each row's blocks are contiguous, a row
permutation (llama.cpp's q/k order -> rotate-half) is a permutation of raw rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvgen.loaders.rope_layout import interleaved_to_half
from kvgen.loaders.gguf_reader import ReaderTensor, release_pages

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# Block-quantized types kvgen reads: the legacy 32-weight blocks, the 256-weight K-quants and MXFP4
# (32 e2m1 values and an e8m0 exponent, gpt-oss's experts).
BLOCK_TYPES = frozenset({
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K, GGMLQuantizationType.MXFP4,
})
SUPPORTED_TYPES = FLOAT_TYPES | BLOCK_TYPES


class UnsupportedTensorType(ValueError):
    """A tensor type kvgen cannot read (IQ*, TQ*, ...); the loader names the file."""


@dataclass(frozen=True)
class GGUFWeight:
    """One GGUF tensor, bytes as stored.

    `shape` is in torch order ([out, in] for a matrix; GGUF lists it reversed). `raw` is uint8
    [rows, bytes_per_row] with rows = prod(shape[:-1]): row r holds the blocks of weights
    [r, 0:in]. It may be a read-only view of the memory-mapped file.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def is_quantized(self) -> bool:
        return self.ggml_type in BLOCK_TYPES

    def dequantize(self) -> torch.Tensor:
        """float32 values of `shape`, as `gguf.quants.dequantize` computes them."""
        values = gguf.quants.dequantize(self.raw, self.ggml_type).reshape(self.shape)
        # F32 comes back as a view of the (read-only, memory-mapped) bytes.
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def dequantize_rows(self, rows: list[int]) -> torch.Tensor:
        """float32 rows [len(rows), in] of a matrix, as `dequantize` computes them, reading only
        those rows' blocks."""
        values = gguf.quants.dequantize(self.raw[np.asarray(rows)], self.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(len(rows), self.shape[-1]))

    def release(self) -> None:
        """Done with `raw`: where it is the file's memory map, its pages leave this process's resident
        set (a later read maps them again; kvgen.loaders.gguf_reader.release_pages)."""
        release_pages(self.raw)

    def permute_rows(self, order: np.ndarray) -> GGUFWeight:
        """The weight with row i taken from row order[i] (a matrix; each row's blocks move as one)."""
        return GGUFWeight(self.name, self.ggml_type, self.shape, self.raw[order])


def read_tensor(tensor: ReaderTensor, name: str) -> GGUFWeight:
    """A reader tensor (bytes as a uint8 view of the map) as a GGUFWeight named `name`; raises
    UnsupportedTensorType for other types."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"tensor {tensor.name} is {tensor.tensor_type.name}, which kvgen does not read "
                                    f"(it reads {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF dims are fastest-first
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return GGUFWeight(name, tensor.tensor_type, shape, tensor.data.reshape(rows, -1))


def rotate_half_rows(weight: GGUFWeight, n_heads: int) -> GGUFWeight:
    """A q/k projection matrix with rows in HF's rotate-half order (see `interleaved_to_half`)."""
    order = interleaved_to_half(torch.arange(weight.shape[0]), n_heads).numpy()
    return weight.permute_rows(order)
