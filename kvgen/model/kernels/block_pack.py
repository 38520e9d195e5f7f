"""Packing GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and MXFP4 matrices into formats.py's layout, in C (block_pack.c).

A load packs every matrix of such a file, 0.7-1.3 GB for a 1B model: numpy's reshapes and
transposes took 4-8 s of it, the C packer reads each row's blocks once, in place from the file's
memory map, and writes the final layout (gguf_blocks.convert and kvgen.model.linear_choice call it).
Plain C with no ISA flags, so it builds wherever a C compiler does; where none does `block_packer()`
is None and those matrices are dequantized to floats instead (as types without a kernel format are).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.model.kernels.build import build_library
from kvgen.model.formats.packed import GROUP, PANEL, PackedWeight

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
SOURCE = Path(__file__).with_name("block_pack.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# type -> (the C function's suffix, bits of a code, offset, has a min, codebook)
BLOCK_TYPES = {Q.Q4_0: ("q4_0", 4, 8, False, None), Q.Q4_1: ("q4_1", 4, 0, True, None),
               Q.Q8_0: ("q8_0", 8, 128, False, None), Q.Q5_0: ("q5_0", 8, 128, False, None),
               Q.Q5_1: ("q5_1", 8, 128, True, None), Q.MXFP4: ("mxfp4", 4, 12, False, "e2m1")}
# MXFP4's e8m0 exponents whose scale 2^(e - 128) is an fp16 (block_pack.c)
FP16_EXPONENTS = range(104, 144)
_P = ctypes.c_void_p


def row_pointers(ggml_type: GGMLQuantizationType, parts: Sequence[np.ndarray], kinds: object,
                 what: str) -> tuple[np.ndarray, int]:
    """Matrices' blocks (each uint8 [rows, bytes per row], rows of one width and contiguous bytes, any
    row stride) stacked by rows -> (uint64 [rows]: the address of each row's blocks, columns): what
    the C packers read. ValueError, naming `what`, unless `ggml_type` is in `kinds` and the parts fit."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    width = parts[0].shape[1] if parts and parts[0].ndim == 2 else 0
    if ggml_type not in kinds or not width or width % type_size or any(
            p.ndim != 2 or p.shape[1] != width or p.dtype != np.uint8 or p.strides[1] != 1 for p in parts):
        shapes = [(p.shape, p.dtype) for p in parts]
        raise ValueError(f"{ggml_type.name} blocks {shapes} do not hold a {what} matrix")
    rows = np.concatenate([p.__array_interface__["data"][0] + p.strides[0] * np.arange(len(p), dtype=np.uint64)
                           for p in parts]).astype(np.uint64)
    return rows, width // type_size * block_size


class BlockPacker:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for ggml_type, (suffix, *_) in BLOCK_TYPES.items():
            for dtype, name in ((torch.float16, suffix), (torch.float32, f"{suffix}_f32")):
                if hasattr(library, f"bp_pack_{name}"):
                    function = getattr(library, f"bp_pack_{name}")
                    function.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, ctypes.c_int32]
                    function.restype = None
                    self._functions[ggml_type, dtype] = function

    def pack(self, ggml_type: GGMLQuantizationType, parts: Sequence[np.ndarray]) -> PackedWeight:
        """Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4 matrices' blocks (each uint8 [rows, bytes per row]; views of the
        file's memory map are read in place) stacked by rows -> PackedWeight, in one pass. A part's
        rows may be any row-strided view, such as a permutation's copy."""
        rows, cols = row_pointers(ggml_type, parts, BLOCK_TYPES, "Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4")
        _, bits, offset, has_min, codebook = BLOCK_TYPES[ggml_type]
        panels = -(-len(rows) // PANEL)
        codes = torch.empty(panels, cols * PANEL * bits // 8, dtype=torch.uint8)
        scale = torch.empty(panels, cols // GROUP * PANEL, dtype=_scale_dtype(ggml_type, parts))
        mins = torch.empty_like(scale) if has_min else None
        self._functions[ggml_type, scale.dtype](rows.ctypes.data, len(rows), cols, codes.data_ptr(), scale.data_ptr(),
                                                None if mins is None else mins.data_ptr(), torch.get_num_threads())
        return PackedWeight(codes, scale, mins, offset, bits, GROUP, (len(rows), cols), codebook)


def _scale_dtype(ggml_type: GGMLQuantizationType, parts: Sequence[np.ndarray]) -> torch.dtype:
    """fp16, the files' scales, but for MXFP4 matrices with an exponent past fp16's range: fp32."""
    if ggml_type != Q.MXFP4:
        return torch.float16
    block = GGML_QUANT_SIZES[ggml_type][1]
    exponents = [p[:, ::block] for p in parts if p.size]
    narrow = all(FP16_EXPONENTS.start <= e.min() and e.max() < FP16_EXPONENTS.stop for e in exponents)
    return torch.float16 if narrow else torch.float32


@functools.cache
def block_packer() -> BlockPacker | None:
    """The packer, built once per machine, or None where the build fails."""
    try:
        return BlockPacker(ctypes.CDLL(str(build_library(SOURCE, FLAGS))))
    except OSError as e:
        log.warning("block packer unavailable (%s); Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4 matrices are dequantized", e)
        return None
