"""kvgen's GGUF reader against gguf's own `GGUFReader` on real files: the same metadata (key by key, value
by value, type by type) and the same tensors; and a clear ValueError for each way a file can be broken."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvgen.loaders.gguf_reader import read_gguf, release_pages
from tests.conftest import SMOLLM_GGUF, STORIES_DIR
from tests.support.cached_files import gguf_reading

STORIES_GGUF = STORIES_DIR / "stories260K.gguf"
# 242 MB, not kept in the shared directory: /work/shared/models/gemma-3-270m/fetch.sh puts it here.
GEMMA_GGUF = Path.home() / ".cache" / "kvgen-test-models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(params=[STORIES_GGUF, SMOLLM_GGUF, GEMMA_GGUF], ids=lambda p: p.name)
def real_gguf(request) -> Path:
    if not request.param.is_file():
        pytest.skip(f"{request.param} is absent (the Gemma file: run shared/models/gemma-3-270m/fetch.sh)")
    return request.param


def _same_value(ours, theirs) -> bool:
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(map(_same_value, ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def test_metadata_and_tensors_equal_gguf_readers(real_gguf):
    """Against gguf's reading of the file (saved once: tests/support/cached_files.gguf_reading); a
    tensor's bytes are the file's at the offset and length gguf read."""
    ours, reference = read_gguf(real_gguf), gguf_reading(real_gguf)
    expected = reference["metadata"]
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert _same_value(ours.metadata[key], value), key
    assert [t.name for t in ours.tensors] == [name for name, *_ in reference["tensors"]]
    file = np.memmap(real_gguf, dtype=np.uint8, mode="r")
    for mine, (name, shape, tensor_type, offset, size) in zip(ours.tensors, reference["tensors"]):
        assert mine.shape == tuple(shape), name
        assert (mine.tensor_type, mine.offset) == (tensor_type, offset), name
        assert mine.data.dtype == np.uint8 and not mine.data.flags.writeable, name
        assert np.array_equal(mine.data, file[offset : offset + size]), name


def test_every_value_type_and_an_alignment_as_gguf_reads_them(tmp_path):
    """A file from gguf's own writer with each scalar type, nested and empty arrays, non-ASCII strings
    and a 64-byte alignment: the cases the three real files do not have."""
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for name in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"):
        getattr(writer, f"add_{name}")(f"test.{name}", 7 if name.startswith("u") else -7)
    writer.add_float32("test.float32", 1e-5)
    writer.add_float64("test.float64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "café 日本語 🙂")
    writer.add_array("test.floats", [0.1, -2.5, 3.0])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.strings", ["", "a", "e\u0301"])
    writer.add_array("test.nested", [[1, 2], [3], [4, 5, 6]])
    writer.add_array("test.nested_strings", [["a", "b"], ["c"]])
    writer.add_array("test.empty", [])
    writer.add_tensor("x", np.arange(30, dtype=np.float32).reshape(3, 10))
    writer.add_tensor("y", np.ones(5, dtype=np.float16))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    ours, reference = read_gguf(path), gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in reference.fields.items()}
    assert list(ours.metadata) == list(expected) and all(_same_value(ours.metadata[k], v) for k, v in expected.items())
    assert ours.metadata["test.nested"] == [1, 2, 3, 4, 5, 6]  # flattened, as gguf's contents() gives it
    assert [(t.name, t.shape, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.data_offset) for t in reference.tensors]
    assert ours.tensors[1].offset - ours.tensors[0].offset == 128  # x's 120 bytes, padded to 64
    assert np.array_equal(ours.tensors[0].data.view(np.float32), np.arange(30, dtype=np.float32))


def test_tensor_data_are_views_of_one_map():
    tensors = read_gguf(SMOLLM_GGUF if SMOLLM_GGUF.is_file() else STORIES_GGUF).tensors
    bases = {id(t.data.base) for t in tensors}
    assert len(bases) == 1 and not any(t.data.flags.owndata for t in tensors)


# -- broken copies of stories260K.gguf ----------------------------------------------------------------

def _value_at(data: bytearray, key: str) -> int:
    """Offset of the value type (u32) of metadata `key`; the value follows it."""
    return data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)


def _tensor_type_at(data: bytearray, name: str) -> int:
    info = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    return info + 4 + 8 * struct.unpack_from("<I", data, info)[0]


def _bad_magic(data: bytearray) -> None:
    data[:4] = b"GGML"


def _version_1(data: bytearray) -> None:
    struct.pack_into("<I", data, 4, 1)


def _unknown_value_type(data: bytearray) -> None:
    struct.pack_into("<I", data, _value_at(data, "general.architecture"), 99)


def _string_past_the_end(data: bytearray) -> None:
    struct.pack_into("<Q", data, _value_at(data, "general.architecture") + 4, 1 << 40)


def _token_past_the_end(data: bytearray) -> None:
    """The first token's length prefix, after the array's item type and count."""
    struct.pack_into("<Q", data, _value_at(data, "tokenizer.ggml.tokens") + 16, 1 << 40)


def _array_past_the_end(data: bytearray) -> None:
    struct.pack_into("<Q", data, _value_at(data, "tokenizer.ggml.scores") + 8, 1 << 40)


def _unknown_tensor_type(data: bytearray) -> None:
    struct.pack_into("<I", data, _tensor_type_at(data, "token_embd.weight"), 99)


def _truncated_data(data: bytearray) -> None:
    del data[len(data) * 2 // 3:]


def _truncated_header(data: bytearray) -> None:
    del data[3000:]


def _empty(data: bytearray) -> None:
    del data[:]


BROKEN = {
    "bad magic": (_bad_magic, "bad magic b'GGML'"),
    "version 1": (_version_1, "GGUF version 1 is not supported"),
    "unknown value type": (_unknown_value_type, "'general.architecture': unknown value type 99"),
    "string past the end": (_string_past_the_end, "a string of 1099511627776 bytes at offset .* runs past the end"),
    "token past the end": (_token_past_the_end, "runs past the end of the file"),
    "array past the end": (_array_past_the_end, "'tokenizer.ggml.scores': an array of 1099511627776 items runs past"),
    "unknown tensor type": (_unknown_tensor_type, "tensor 'token_embd.weight' has unknown ggml type 99"),
    "truncated data": (_truncated_data, "bytes at offset .* run past the end of the file"),
    "truncated header": (_truncated_header, "runs past the end of the file"),
    "empty": (_empty, "shorter than a GGUF header"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_file_raises_a_clear_value_error(case, tmp_path):
    break_it, message = BROKEN[case]
    data = bytearray(STORIES_GGUF.read_bytes())
    break_it(data)
    path = tmp_path / "broken.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=message):
        read_gguf(path)


def _rss_file() -> int:
    """This process's resident file-backed pages, in bytes (Linux /proc)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


def test_released_tensor_pages_leave_the_resident_set_and_read_the_same():
    """SmolLM2's 98 MB file: once its tensors are released their pages are no longer this process's
    (RssFile falls by about their size), and reading them again gives the same bytes (from the page cache)."""
    tensors = read_gguf(SMOLLM_GGUF).tensors
    sums = [int(t.data.sum(dtype=np.uint64)) for t in tensors]  # every page read: resident
    touched = _rss_file()
    for t in tensors:
        release_pages(t.data)
    size = sum(t.data.nbytes for t in tensors)
    assert touched - _rss_file() > 0.9 * size
    assert [int(t.data.sum(dtype=np.uint64)) for t in tensors] == sums
    release_pages(np.array(tensors[0].data))  # a copy is not the map's: left alone
