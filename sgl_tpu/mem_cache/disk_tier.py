"""The disk tier below the host tier (`--hicache-storage-backend file`): one file per page,
named by its chain hash, in a folder per model fingerprint, so a restarted server with the same
model, dtype, page size and KV layout finds the prefixes computed before.

    DIR/<fingerprint>/<chain hash hex>.kv

    header   magic "SGLTPUKV", format version, fingerprint (16 bytes), chain hash (16 bytes),
             page size, row bytes, CRC-32 of the row         (struct `_HEADER`, little-endian)
    tokens   int32 [page size]   the page's token ids
    row      the page's raw-bit KV row (the runner's page-row layout)

A file is written to a temporary name and renamed, so a reader never sees half of one. Reads
check everything: a truncated, corrupt or foreign file (other fingerprint, other tokens) is
skipped with a warning and forgotten, never served. Writes run on a background thread, in
order; a page queued but not yet written is read from the queue. The first write that fails (a
full disk, a read-only folder) turns writing off with a warning: the server goes on host-only.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

_MAGIC = b"SGLTPUKV"
_VERSION = 1
_HEADER = struct.Struct("<8sI16s16sIQI")
_SUFFIX = ".kv"


class DiskTier:
    def __init__(self, directory: str | os.PathLike, fingerprint: bytes, page_size: int,
                 row_elems: int, dtype: np.dtype) -> None:
        """OSError if the folder cannot be made or listed (the caller then runs without it)."""
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.dtype = np.dtype(dtype)
        self.row_bytes = row_elems * self.dtype.itemsize
        self.row_elems = row_elems
        self.dir = Path(directory) / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.index: set[bytes] = set()
        for path in self.dir.iterdir():
            if path.suffix == _SUFFIX and len(path.stem) == 2 * len(fingerprint):
                try:
                    self.index.add(bytes.fromhex(path.stem))
                except ValueError:
                    continue
        self.writable = True
        self._pending: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._queue: queue.Queue[tuple[bytes, np.ndarray, np.ndarray] | None] = queue.Queue()
        self.write_bytes = 0
        self.write_s = 0.0
        self.skipped_files = 0
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def __contains__(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self.index

    def _path(self, page_hash: bytes) -> Path:
        return self.dir / (page_hash.hex() + _SUFFIX)

    # ---- writes ----------------------------------------------------------------------------
    def write(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray) -> None:
        """Queue a page for writing (`row` is copied); a no-op if held or writing is off."""
        with self._lock:
            if not self.writable or page_hash in self.index:
                return
            self.index.add(page_hash)
            self._pending[page_hash] = (np.array(tokens, dtype=np.int32), np.array(row))
        self._queue.put((page_hash, *self._pending[page_hash]))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            page_hash, tokens, row = item
            written = False
            if self.writable:
                t0 = time.perf_counter()
                try:
                    self._write_file(page_hash, tokens, row)
                    written = True
                except OSError as e:
                    self.writable = False
                    logger.warning("KV disk tier: writing in %s failed (%s); going on with the "
                                   "host tier only", self.dir, e)
                self.write_s += time.perf_counter() - t0
                self.write_bytes += self.row_bytes if written else 0
            with self._lock:
                self._pending.pop(page_hash, None)
                if not written:
                    self.index.discard(page_hash)
            self._queue.task_done()

    def _write_file(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray) -> None:
        data = np.ascontiguousarray(row).tobytes()
        header = _HEADER.pack(_MAGIC, _VERSION, self.fingerprint, page_hash, self.page_size,
                              len(data), zlib.crc32(data))
        path = self._path(page_hash)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def queued(self) -> int:
        """Pages waiting to be written."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Wait until every queued page is written."""
        self._queue.join()

    # ---- reads -----------------------------------------------------------------------------
    def read(self, page_hash: bytes, tokens: np.ndarray) -> np.ndarray | None:
        """The page's row if a valid file for exactly these tokens exists, else None."""
        with self._lock:
            if page_hash not in self.index:
                return None
            pending = self._pending.get(page_hash)
        if pending is not None:
            return pending[1] if np.array_equal(pending[0], tokens) else None
        path = self._path(page_hash)
        problem = None
        try:
            blob = path.read_bytes()
        except OSError as e:
            blob, problem = b"", f"unreadable ({e})"
        if problem is None:
            problem = self._check(blob, page_hash, tokens)
        if problem is not None:
            self.skipped_files += 1
            logger.warning("KV disk tier: skipping %s: %s", path.name, problem)
            with self._lock:
                self.index.discard(page_hash)
            return None
        start = _HEADER.size + 4 * self.page_size
        return np.frombuffer(blob, dtype=self.dtype, offset=start).copy()

    def _check(self, blob: bytes, page_hash: bytes, tokens: np.ndarray) -> str | None:
        expected = _HEADER.size + 4 * self.page_size + self.row_bytes
        if len(blob) != expected:
            return f"{len(blob)} bytes, expected {expected} (truncated or foreign)"
        magic, version, fingerprint, file_hash, page_size, row_bytes, crc = \
            _HEADER.unpack_from(blob)
        if magic != _MAGIC or version != _VERSION:
            return "not a KV page file of this format"
        if fingerprint != self.fingerprint or page_size != self.page_size \
                or row_bytes != self.row_bytes:
            return "written for another model, dtype, page size or KV layout"
        if file_hash != page_hash:
            return "its chain hash differs from its name"
        file_tokens = np.frombuffer(blob, dtype="<i4", count=self.page_size,
                                    offset=_HEADER.size)
        if not np.array_equal(file_tokens, tokens):
            return "it holds other tokens"
        if zlib.crc32(memoryview(blob)[_HEADER.size + 4 * self.page_size:]) != crc:
            return "checksum mismatch (corrupt)"
        return None

    # ---- lifetime --------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every page of this fingerprint (`/flush_cache`)."""
        self.flush()
        with self._lock:
            self.index.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.writable = False
            logger.warning("KV disk tier: cannot recreate %s (%s); host tier only", self.dir, e)

    def close(self) -> None:
        """Write what is queued, then end the writer thread."""
        self._queue.put(None)
        self._thread.join()

    def bytes_on_disk(self) -> int:
        return len(self) * (_HEADER.size + 4 * self.page_size + self.row_bytes)
