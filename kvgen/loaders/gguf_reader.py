"""A small read-only GGUF parser: metadata as Python values, tensors as views of one memory map.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every value, three per string,
786k for Gemma 3's 262,144-token vocabulary: opening gemma-3-270m-q4_k_m.gguf and calling
`field.contents()` took 11-19 s on a shared 2-core machine (SmolLM2-135M Q4_1: 4.5 s). This reads
them in 0.11-0.19 s (0.05 s): one pass over the header with `struct` (the 262k strings are 80 ms of
it), numeric arrays as one `np.frombuffer` each, and no copy of the tensor data.

Format (versions 2 and 3, little-endian): https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
The file is: magic, version, tensor count, key-value count; the key-value pairs; the tensor infos
(name, dimensions, ggml type, offset); padding to `general.alignment`; the tensor data.

Once a tensor's bytes are converted (packed for a kernel, dequantized), `release_pages` drops them
from this process's resident set: the map stays, the page cache keeps the bytes, and a later read of
them maps them again. Otherwise the file's bytes (0.8 GB for a 1B Q4_K_M) would stay resident beside
their packed copy until the whole map goes, and count in the load's peak RSS.

`metadata` has the shape of gguf's `{key: field.contents()}`, so either reader's output serves the
loaders: the three header entries GGUF.version, GGUF.tensor_count and GGUF.kv_count first, then every key in file order;
strings as str, numbers as int/float/bool, arrays as lists, arrays of arrays flattened into one list.
A truncated or corrupt file raises ValueError saying what is wrong and where.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Little-endian struct formats of the scalar value types; also their numpy dtypes (np.dtype("<I") is uint32).
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_PAGE = mmap.PAGESIZE
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class ReaderTensor:
    """One tensor: `shape` as GGUF lists it (fastest-varying dimension first, the reverse of numpy's);
    `offset` the absolute file offset of its bytes; `data` those bytes, a read-only uint8 view of the map."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF: `metadata` as described above, `tensors` in file order."""

    metadata: dict[str, Any]
    tensors: list[ReaderTensor]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses the header of the GGUF at `path` and maps its tensor data (read-only, not copied)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError("file is shorter than a GGUF header (24 bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf)
    except struct.error:  # unpack_from past the end of the map
        raise ValueError("the header runs past the end of the file") from None


def _parse(buf: mmap.mmap) -> GGUFFile:
    if buf[:4] != _MAGIC:
        raise ValueError(f"bad magic {buf[:4]!r} (a GGUF file starts with {_MAGIC!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (versions {_VERSIONS} are; "
                         "a big-endian file reads as a huge version)")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    pos = _read_metadata(buf, 24, n_kv, metadata)
    infos, pos = _read_tensor_infos(buf, pos, n_tensors)
    alignment = _alignment(metadata)
    data_start = -(-pos // alignment) * alignment
    data = np.frombuffer(buf, dtype=np.uint8)
    return GGUFFile(metadata, [_tensor(data, data_start, *info) for info in infos])


def _read_metadata(buf: mmap.mmap, pos: int, count: int, into: dict[str, Any]) -> int:
    """Reads `count` key-value pairs into `into`; returns the offset after them."""
    for _ in range(count):
        key, pos = _string(buf, pos)
        if key in into:
            raise ValueError(f"metadata key {key!r} appears twice")
        (value_type,) = _U32.unpack_from(buf, pos)
        into[key], pos = _value(buf, pos + 4, value_type, key)
    return pos


def _value(buf: mmap.mmap, pos: int, value_type: int, key: str) -> tuple[Any, int]:
    """The value of `value_type` at `pos` and the offset after it."""
    if value_type == GGUFValueType.STRING:
        return _string(buf, pos)
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        return _array(buf, pos + 12, item_type, count, key)
    fmt = _scalar_format(value_type, key)
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _array(buf: mmap.mmap, pos: int, item_type: int, count: int, key: str) -> tuple[list[Any], int]:
    """`count` items of `item_type` at `pos` as one flat list, and the offset after them."""
    if item_type == GGUFValueType.STRING:
        return _strings(buf, pos, count)
    if item_type == GGUFValueType.ARRAY:
        items: list[Any] = []
        for _ in range(count):
            inner_type, inner_count = struct.unpack_from("<IQ", buf, pos)
            inner, pos = _array(buf, pos + 12, inner_type, inner_count, key)
            items += inner
        return items, pos
    dtype = np.dtype(_scalar_format(item_type, key))
    end = pos + count * dtype.itemsize
    if end > len(buf):
        raise ValueError(f"metadata {key!r}: an array of {count} items runs past the end of the file")
    return np.frombuffer(buf, dtype, count, pos).tolist(), end


def _strings(buf: mmap.mmap, pos: int, count: int) -> tuple[list[str], int]:
    """`count` length-prefixed UTF-8 strings at `pos`. The hot loop of a large vocabulary, so unchecked: a
    length running past the end shows as a short slice, then as struct.error at the next length, a decoding
    error, or the check below."""
    unpack, out = _U64.unpack_from, []
    try:
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8 + length
            out.append(str(buf[pos - length:pos], "utf-8"))
    except UnicodeDecodeError as e:
        if pos <= len(buf):
            raise ValueError(f"string {len(out)} of an array is not UTF-8: {e}") from None
    if pos > len(buf):
        raise ValueError(f"string {len(out)} of an array runs past the end of the file")
    return out, pos


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError(f"a string of {length} bytes at offset {pos} runs past the end of the file")
    return str(buf[pos + 8:end], "utf-8"), end


def _scalar_format(value_type: int, key: str) -> str:
    if value_type not in _SCALAR_FORMATS:
        raise ValueError(f"metadata {key!r}: unknown value type {value_type}")
    return _SCALAR_FORMATS[value_type]


def _read_tensor_infos(buf: mmap.mmap, pos: int, count: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    """(name, GGUF shape, raw type, data offset) of each tensor, and the offset after the infos."""
    infos, names = [], set()
    for _ in range(count):
        name, pos = _string(buf, pos)
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        (n_dims,) = _U32.unpack_from(buf, pos)
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (GGUF allows {_MAX_DIMS})")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        raw_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        infos.append((name, shape, raw_type, offset))
        pos += 4 + 8 * n_dims + 12
    return infos, pos


def _alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _tensor(data: np.ndarray, data_start: int, name: str, shape: tuple[int, ...], raw_type: int,
            offset: int) -> ReaderTensor:
    """The tensor's record, its bytes checked to lie inside the file."""
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if shape and shape[0] % block_size:
        raise ValueError(f"tensor {name!r}: a row of {shape[0]} is not whole {tensor_type.name} blocks of {block_size}")
    n_bytes = math.prod(shape) // block_size * type_size
    start = data_start + offset
    if start + n_bytes > len(data):
        raise ValueError(f"tensor {name!r}: its {n_bytes} bytes at offset {start} run past the end of the file")
    return ReaderTensor(name, tensor_type, tuple(shape), start, data[start:start + n_bytes])


def release_pages(data: np.ndarray) -> None:
    """Drops the whole pages under `data` from the resident set if it is a contiguous view of a GGUF's
    memory map (see the module docstring); anything else, such as a copy, is left alone."""
    mapped = _map_of(data)
    if mapped is None or not data.flags.c_contiguous:
        return
    buf, offset = mapped
    start, end = -(-offset // _PAGE) * _PAGE, (offset + data.nbytes) // _PAGE * _PAGE
    if end > start:
        buf.madvise(mmap.MADV_DONTNEED, start, end - start)


def _map_of(data: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """(the memory map under `data`, the byte offset of `data` in it), or None if `data` is not a view of one."""
    root, base = data, data.base
    while isinstance(base, np.ndarray):
        root, base = base, base.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)):
        return None
    return base.obj, data.__array_interface__["data"][0] - root.__array_interface__["data"][0]
