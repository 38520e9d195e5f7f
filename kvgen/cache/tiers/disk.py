"""The disk tier: one file per block in a directory, kept across restarts.

    <dir>/<digest hex>.kvb     header | token ids (int32) | payload

    header  magic "KVGT", version, model identity (32 bytes), block digest (16), token count,
            payload bytes, crc32 of tokens + payload

Writes run on a background thread (kvgen.cache.tiers.writer): `put` reserves the block's place in the
index and budget at once and hands the payload over; until its file is renamed into place, a `get`
of that block is served from the payload in memory. The writer goes to a temporary file that is
renamed into place (a reader never sees half a block). A new tier on a directory first waits for
this process's pending writes there, as `kvgen cache ls` does (and every pending write is finished
at exit); a server killed mid-write loses only its pending blocks. The index is rebuilt on start by reading every file's header: a file of another model or KV layout is
left alone and never read; a truncated one or a stale temporary file (its writer was killed) is
removed; each kind of fault is logged once. A block whose checksum or tokens do not match when read
is removed and recomputed. The budget is kept by removing the least recently used files. A full disk
(or any other write error) turns the tier off with one warning; the engine keeps serving.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from kvgen.cache.tiers.writer import BackgroundWriter

log = logging.getLogger(__name__)
PENDING_LIMIT = 256 << 20  # bytes of blocks handed to the writer and not yet written before `put` waits
_LIVE: weakref.WeakSet[DiskTier] = weakref.WeakSet()


def flush_writes(directory: str | os.PathLike) -> None:
    """Waits for this process's pending block writes into `directory` (a new tier there, or a listing,
    then sees every block given so far)."""
    where = Path(directory).resolve()
    for tier in list(_LIVE):
        if tier.dir.resolve() == where:
            tier.flush()


@atexit.register
def _flush_all() -> None:
    for tier in list(_LIVE):
        tier.flush()

MAGIC = b"KVGT"
VERSION = 1
_HEADER = struct.Struct("<4sI32s16sIQI")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_header(path: Path) -> tuple[bytes, bytes, int, int, int] | None:
    """(identity, digest, num_tokens, payload bytes, crc) of a block file, None if it has no valid header."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError:
        return None
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, identity, digest, ntok, nbytes, crc = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return identity, digest, ntok, nbytes, crc


class DiskTier:
    """digest -> a block file of this model's identity; at most `capacity` bytes of files."""

    def __init__(self, directory: str | os.PathLike, capacity: int, identity: bytes) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.identity = identity
        self.enabled = True
        self.nbytes = 0
        self._files: OrderedDict[bytes, int] = OrderedDict()  # digest -> file size, least recent first
        # blocks handed to the writer whose file is not in place yet: digest -> (token ids, payload)
        self._pending: dict[bytes, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._lock = threading.Lock()  # the index (_files, nbytes, _pending), shared with the writer
        self._writer = BackgroundWriter(self._write, PENDING_LIMIT)
        self._warned: set[str] = set()
        self.faults: dict[str, int] = {}
        flush_writes(self.dir)
        self._scan()
        _LIVE.add(self)

    def flush(self) -> None:
        """Waits until every block given to `put` so far is written (or dropped)."""
        self._writer.flush()

    # -- the index ------------------------------------------------------------------------------

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)

    def _scan(self) -> None:
        entries = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                self._remove_stale_temp(path)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            header = read_header(path)
            try:
                stat = path.stat()
            except OSError:
                continue
            if header is None:
                self._warn_once("corrupt", "KV disk tier: %s has no valid block header; removed, its "
                                "tokens will be recomputed", path)
                self._unlink(path)
                continue
            identity, digest, ntok, nbytes, _ = header
            if identity != self.identity:
                self._warn_once("foreign", "KV disk tier: %s holds blocks of another model or KV layout; "
                                "they are never read by this one", self.dir)
                continue
            if stat.st_size != HEADER_BYTES + 4 * ntok + nbytes or path.stem != digest.hex():
                self._warn_once("truncated", "KV disk tier: %s is truncated or misnamed; removed, its "
                                "tokens will be recomputed", path)
                self._unlink(path)
                continue
            entries.append((stat.st_mtime, digest, stat.st_size))
        for _, digest, size in sorted(entries):
            self._files[digest] = size
            self.nbytes += size
        self._shrink(0)

    def _remove_stale_temp(self, path: Path) -> None:
        try:
            pid = int(path.name.split(".")[-2])
        except (ValueError, IndexError):
            pid = -1
        if pid > 0 and pid != os.getpid() and _pid_alive(pid):
            return  # another server is writing it now
        self._warn_once("torn", "KV disk tier: %s is an unfinished write (its server stopped mid-write); "
                        "removed", path)
        self._unlink(path)

    def _path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}{SUFFIX}"

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def __contains__(self, digest: bytes) -> bool:
        return self.enabled and digest in self._files

    def __len__(self) -> int:
        return len(self._files)

    # -- blocks ---------------------------------------------------------------------------------

    def get(self, digest: bytes, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's payload, None (the file removed, one warning) if it is not exactly what was written."""
        if digest not in self:
            return None
        with self._lock:
            pending = self._pending.get(digest)
            if pending is not None:  # its write has not finished: served from memory
                self._files.move_to_end(digest)
                return pending[1] if pending[0] == tuple(token_ids) else None
        path = self._path(digest)
        try:
            raw = path.read_bytes()
        except OSError:
            with self._lock:
                self._forget(digest)
            return None
        payload = self._check(raw, digest, token_ids)
        with self._lock:
            if payload is None:
                self._warn_once("corrupt", "KV disk tier: %s failed its checksum (or holds other tokens); "
                                "removed, its tokens are recomputed", path)
                self._forget(digest)
                self._unlink(path)
                return None
            if digest in self._files:
                self._files.move_to_end(digest)
        return payload

    def _check(self, raw: bytes, digest: bytes, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        if len(raw) < HEADER_BYTES:
            return None
        magic, version, identity, file_digest, ntok, nbytes, crc = _HEADER.unpack_from(raw)
        body = memoryview(raw)[HEADER_BYTES:]
        if (magic, version, identity, file_digest) != (MAGIC, VERSION, self.identity, digest) \
                or len(body) != 4 * ntok + nbytes or zlib.crc32(body) != crc:
            return None
        if tuple(np.frombuffer(body[:4 * ntok], dtype=np.int32).tolist()) != tuple(token_ids):
            return None
        return torch.frombuffer(bytearray(body[4 * ntok:]), dtype=torch.uint8)

    def put(self, digest: bytes, token_ids: tuple[int, ...], payload: torch.Tensor,
            pinned: set[bytes] = frozenset()) -> None:
        """Takes the block (unless it is there) into the index and the budget, removing the oldest files
        to make room, and hands it to the writer."""
        size = HEADER_BYTES + 4 * len(token_ids) + payload.numel()
        with self._lock:
            if not self.enabled or digest in self._files:
                if digest in self._files:
                    self._files.move_to_end(digest)
                return
            if size > self.capacity:
                return
            self._shrink(size, pinned)
            if self.nbytes + size > self.capacity:
                return
            self._files[digest] = size
            self.nbytes += size
            self._pending[digest] = (tuple(token_ids), payload)
        self._writer.submit(digest, size)

    def _write(self, digest: bytes) -> None:
        """The writer thread's job: the block's file, atomically, unless the block was dropped meanwhile."""
        with self._lock:
            if not self.enabled:  # turned off by an earlier failed write: the blocks still queued are dropped
                self._pending.pop(digest, None)
                return
            job = self._pending.get(digest)
        if job is None:
            return
        token_ids, payload = job
        body = np.asarray(token_ids, dtype=np.int32).tobytes() + payload.numpy().tobytes()
        header = _HEADER.pack(MAGIC, VERSION, self.identity, digest, len(token_ids), payload.numel(),
                              zlib.crc32(body))
        path = self._path(digest)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(body)
            if digest not in self._pending:  # dropped (the budget) while being written
                self._unlink(tmp)
                return
            os.replace(tmp, path)  # not under the lock: a slow rename never holds up the engine
            with self._lock:
                if self._pending.pop(digest, None) is None:  # dropped while being renamed
                    self._unlink(path)
        except OSError as error:
            self._unlink(tmp)
            with self._lock:
                self._pending.pop(digest, None)
                self._forget(digest)
                was_on, self.enabled = self.enabled, False
            if not was_on:
                return
            what = "the disk is full" if error.errno == errno.ENOSPC else f"a write failed ({error})"
            log.warning("KV disk tier off: %s in %s; prefixes are kept in the pool and the host tier only",
                        what, self.dir)

    def _shrink(self, room: int, pinned: set[bytes] = frozenset()) -> None:
        """Removes the least recently used blocks (written or pending) until `room` more bytes fit."""
        for digest in [d for d in self._files if d not in pinned]:
            if self.nbytes + room <= self.capacity:
                break
            self._pending.pop(digest, None)
            self._unlink(self._path(digest))
            self._forget(digest)

    def _forget(self, digest: bytes) -> None:
        size = self._files.pop(digest, None)
        if size is not None:
            self.nbytes -= size


def list_blocks(directory: str | os.PathLike) -> dict[bytes, dict[str, int]]:
    """Per model identity in a cache directory: its blocks, bytes and tokens (`kvgen cache ls`)."""
    flush_writes(directory)
    out: dict[bytes, dict[str, int]] = {}
    for path in Path(directory).glob(f"*{SUFFIX}"):
        header = read_header(path)
        if header is None:
            continue
        identity, _, ntok, nbytes, _ = header
        row = out.setdefault(identity, {"blocks": 0, "bytes": 0, "tokens": 0})
        row["blocks"] += 1
        row["bytes"] += HEADER_BYTES + 4 * ntok + nbytes
        row["tokens"] += ntok
    return out


def clear_blocks(directory: str | os.PathLike) -> int:
    """Removes every block file (and temporary file) of a cache directory; returns how many."""
    flush_writes(directory)
    count = 0
    for path in list(Path(directory).glob(f"*{SUFFIX}")) + list(Path(directory).glob("*.tmp")):
        try:
            path.unlink()
            count += 1
        except OSError:
            pass
    return count
