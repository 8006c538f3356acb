"""The disk tier below the host tier (`--hicache-storage-backend file`): one file per page,
named by its chain hash, in a folder per model fingerprint, so a restarted server with the same
model, dtype, page size and KV layout finds the prefixes computed before.

    DIR/<fingerprint>/<chain hash hex>.kv        (DIR: disk_folder.py)

    header   magic "SGLTPUKV", format version, fingerprint (16 bytes), chain hash (16 bytes),
             page size, row bytes                            (struct `_HEADER`, little-endian)
    tokens   int32 [page size]   the page's token ids
    row      the page's raw-bit KV row (the runner's page-row layout)
    mac      HMAC-SHA256 of header, tokens and row under the folder's secret (32 bytes)

Writes run on one background thread, in order; a page queued but not yet written is read from
the queue. A file is written under a temporary name unique to its process and writer
(`<hash>.<pid>-<writer>.tmp`), optionally fsynced (`--hicache-storage-durability fsync`: the file,
then the folder after the rename), then renamed, so a reader never sees half of one; it counts
as stored only then. Reads open a page file without following a symlink or waiting on a FIFO
(O_NOFOLLOW | O_NONBLOCK) and check everything: anything but a regular file of the page size, a
corrupt, planted (no valid mac) or foreign file is skipped with a warning, counted and deleted,
never served. A file that vanished (another server's `/flush_cache` or eviction) is a plain miss.
Every server on a folder signs with its one secret: each write first checks that the secret file
is the one read, a mac that does not match re-checks it, and a changed one is adopted
(disk_folder.py).

Size: the page files this server knows (found at start, written, read) stay under `max_bytes`;
the least recently used (by write or read; at start by mtime) are deleted first. The index is
kept in memory: the folder is listed once, at start, when temporaries whose writer process is
gone are deleted too; names of any other form are left alone, and files that vanish during the
listing (another server evicting) are skipped. A write that fails pauses writing (pages offered
meanwhile are dropped): a full disk first evicts an eighth of this tier's pages and retries once;
writing comes back after a back-off (1 s, doubling to 64 s) or a `/flush_cache`.

Threads: `write`, `read`, `clear` run on the scheduler thread, `read` also on the disk loads'
reader thread (disk_loads.py); `_lock` guards the index (`_files`, `_pending`) and the counters
against the writer thread, which alone creates files and evicts.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sgl_tpu.mem_cache.disk_folder import (
    Secret,
    StorageDirError,
    default_max_bytes,
    fsync_dir,
    make_private_subdir,
    open_storage_dir,
    pid_alive,
    restore_storage_dir,
    secret_file_id,
)

logger = logging.getLogger(__name__)

DURABILITIES = ("none", "fsync")
_MAGIC = b"SGLTPUKV"
_VERSION = 2
_HEADER = struct.Struct("<8sI16s16sIQ")
_MAC_BYTES = 32
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_PAGE_NAME = re.compile(r"([0-9a-f]{32})\.kv")
_TMP_NAME = re.compile(r"[0-9a-f]{32}\.([1-9][0-9]{0,9})-([0-9a-f]{8})\.tmp")  # hash.pid-writer
_BAD_MAC = "its mac does not match this folder's secret (corrupt or planted)"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_MIN_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 64.0
_MAX_QUEUED_BYTES = 256 * 2**20  # rows waiting for the writer; more are dropped
_LIVE_WRITERS: set[str] = set()  # this process's writer tokens (their temporaries are not orphans)


class DiskTier:
    def __init__(self, directory: str | os.PathLike, fingerprint: bytes, page_size: int,
                 row_elems: int, dtype: np.dtype, *, max_bytes: int = 0,
                 durability: str = "none", is_default_dir: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`max_bytes` 0: a quarter of the folder's free space (disk_folder.py). StorageDirError
        if the folder is unsafe (fatal); OSError if it cannot be made or listed (the caller then
        runs without it)."""
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {DURABILITIES}, got {durability!r}")
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.dtype = np.dtype(dtype)
        self.row_bytes = row_elems * self.dtype.itemsize
        self.row_elems = row_elems
        self.file_bytes = _HEADER.size + 4 * page_size + self.row_bytes + _MAC_BYTES
        self.durability = durability
        self.base = Path(directory)
        self._is_default_dir = is_default_dir
        self._secret: Secret = open_storage_dir(self.base, is_default_dir)
        self._secret_lock = threading.Lock()
        self.dir = self.base / fingerprint.hex()
        make_private_subdir(self.dir)
        self._clock = clock
        self._writer = secrets.token_hex(4)
        _LIVE_WRITERS.add(self._writer)
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, None] = OrderedDict()  # stored pages, least recent first
        self._pending: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.skipped_files = 0
        self.evicted_pages = 0
        self.dropped_pages = 0  # offered, not stored: writing paused or failing, queue full
        self._scan()
        self.max_bytes = max_bytes or default_max_bytes(self.dir, self.used_bytes())
        self.max_pages = self.max_bytes // self.file_bytes
        self._unlink(self._pop_lru(len(self._files) - self.max_pages))
        self.writable = True
        self._retry_at = 0.0
        self._backoff_s = _MIN_BACKOFF_S
        self._queue: queue.Queue[tuple[bytes, np.ndarray, np.ndarray] | None] = queue.Queue()
        self._queued_bytes = 0
        self.write_bytes = 0
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        """Index the page files (oldest first); delete orphaned temporaries and bad sizes."""
        found: list[tuple[float, bytes]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(_TMP_SUFFIX):
                if _orphaned(name):
                    _remove(entry.path)
                continue
            page_hash = _hash_of(name)
            if page_hash is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # evicted or flushed by another server meanwhile
                continue
            if st.st_size != self.file_bytes or not stat.S_ISREG(st.st_mode):
                self.skipped_files += 1
                logger.warning("KV disk tier: skipping and deleting %s: %d bytes, expected %d "
                               "(truncated or foreign)", name, st.st_size, self.file_bytes)
                _remove(entry.path)
                continue
            found.append((st.st_mtime, page_hash))
        for _, page_hash in sorted(found):
            self._files[page_hash] = None

    def __len__(self) -> int:
        """Pages stored or queued."""
        with self._lock:
            return len(self._files) + len(self._pending)

    def __contains__(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._files or page_hash in self._pending

    def used_bytes(self) -> int:
        """Bytes of the page files this server knows on disk."""
        with self._lock:
            return len(self._files) * self.file_bytes

    def _path(self, page_hash: bytes) -> Path:
        return self.dir / (page_hash.hex() + _SUFFIX)

    # ---- writes ----------------------------------------------------------------------------
    def write(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray) -> None:
        """Queue a page for writing (`row` is copied); a no-op if held, dropped while writing
        is paused or the queue is full."""
        with self._lock:
            if page_hash in self._files or page_hash in self._pending or self.max_pages == 0:
                return
            if not self._may_write() or self._queued_bytes + self.row_bytes > _MAX_QUEUED_BYTES:
                self.dropped_pages += 1
                return
            item = (np.array(tokens, dtype=np.int32), np.array(row))
            self._pending[page_hash] = item
            self._queued_bytes += self.row_bytes
        self._queue.put((page_hash, *item))

    def _may_write(self) -> bool:
        return self.writable or self._clock() >= self._retry_at

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._store(*item)
            except Exception:  # a bug: keep the thread (a dead one would hang `flush`)
                logger.exception("KV disk tier: writing a page failed")
                with self._lock:
                    self._pending.pop(item[0], None)
                    self._queued_bytes -= self.row_bytes
            finally:
                self._queue.task_done()

    def _store(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray) -> None:
        stored = False
        if self._may_write():
            t0 = time.perf_counter()
            try:
                self._unlink(self._pop_lru(len(self._files) + 1 - self.max_pages))
                stored = self._write_or_make_room(page_hash, tokens, row)
            except (OSError, StorageDirError) as e:  # (the folder was replaced by a foreign one)
                self._pause(e)
            self.write_s += time.perf_counter() - t0
        with self._lock:
            self._pending.pop(page_hash, None)
            self._queued_bytes -= self.row_bytes
            if stored:
                self._files[page_hash] = None
                self.write_bytes += self.row_bytes
            else:
                self.dropped_pages += 1
        if stored and not self.writable:
            self._resume("a write succeeded")

    def _write_or_make_room(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray
                            ) -> bool:
        try:
            self._write_file(page_hash, tokens, row)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._files:
                raise
            # a full disk: free an eighth of this tier's pages and try once more
            self._unlink(self._pop_lru(max(1, len(self._files) // 8)))
            self._write_file(page_hash, tokens, row)
        return True

    def _write_file(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray) -> None:
        self._adopt_folder_secret(restore=True)
        data = np.ascontiguousarray(row).tobytes()
        token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        header = _HEADER.pack(_MAGIC, _VERSION, self.fingerprint, page_hash, self.page_size,
                              len(data))
        mac = hmac.new(self._secret.key, header, hashlib.sha256)
        mac.update(token_bytes)
        mac.update(data)
        path = self._path(page_hash)
        tmp = self.dir / f"{page_hash.hex()}.{os.getpid()}-{self._writer}{_TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # the folder vanished under this server: make it again
            self._adopt_folder_secret(restore=True)
            make_private_subdir(self.dir)
            fd = os.open(tmp, flags, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for part in (header, token_bytes, data, mac.digest()):
                    f.write(part)
                if self.durability == "fsync":
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.durability == "fsync":
            fsync_dir(self.dir)

    def _adopt_folder_secret(self, restore: bool) -> bool:
        """Read the folder's secret again if its file is not the one read before (the folder
        was made again, by this server or another), so that every server on the folder signs
        with one secret; `restore`: make the folder and the secret (this tier's key) again if
        they are gone. True if the key changed. OSError, StorageDirError."""
        with self._secret_lock:
            old = self._secret
            file_id = secret_file_id(self.base)
            if file_id == old.file_id or (file_id is None and not restore):
                return False
            self._secret = restore_storage_dir(self.base, old.key, self._is_default_dir)
        if self._secret.key != old.key:
            logger.info("KV disk tier: %s was made again with another secret; adopted it",
                        self.base)
        return self._secret.key != old.key

    def _pop_lru(self, num_pages: int) -> list[bytes]:
        """Take the `num_pages` least recently used pages out of the index (to delete)."""
        with self._lock:
            victims = [self._files.popitem(last=False)[0]
                       for _ in range(min(max(0, num_pages), len(self._files)))]
        self.evicted_pages += len(victims)
        return victims

    def _unlink(self, hashes: list[bytes]) -> None:
        for page_hash in hashes:
            _remove(self._path(page_hash))

    def _pause(self, e: Exception) -> None:
        if self.writable:
            logger.warning("KV disk tier: writing in %s failed (%s); host tier only, retrying "
                           "in %.0f s", self.dir, e, self._backoff_s)
        else:
            logger.debug("KV disk tier: retry failed (%s)", e)
        self.writable = False
        self._retry_at = self._clock() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, _MAX_BACKOFF_S)

    def _resume(self, why: str) -> None:
        if not self.writable:
            logger.info("KV disk tier: writing in %s resumed (%s)", self.dir, why)
        self.writable = True
        self._backoff_s = _MIN_BACKOFF_S

    def queued(self) -> int:
        """Pages waiting to be written."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Wait until every queued page is written."""
        self._queue.join()

    # ---- reads -----------------------------------------------------------------------------
    def read(self, page_hash: bytes, tokens: np.ndarray) -> np.ndarray | None:
        """The page's row if a valid file for exactly these tokens exists (one this server
        indexes, or one another server sharing the folder wrote), else None."""
        with self._lock:
            pending = self._pending.get(page_hash)
            indexed = page_hash in self._files
            if indexed:
                self._files.move_to_end(page_hash)
        if pending is not None:
            return pending[1] if np.array_equal(pending[0], tokens) else None
        path = self._path(page_hash)
        try:
            blob, problem = self._read_file(path)
        except (FileNotFoundError, NotADirectoryError):  # never written, or deleted by
            # another server (its eviction or `/flush_cache`): a miss
            if indexed:
                self._forget(page_hash)
            return None
        if problem is None:
            problem = self._check(blob, page_hash, tokens)
        if problem == _BAD_MAC and self._may_adopt_folder_secret():
            problem = self._check(blob, page_hash, tokens)
        if problem is not None:
            with self._lock:
                self.skipped_files += 1
            logger.warning("KV disk tier: skipping and deleting %s: %s", path.name, problem)
            self._forget(page_hash)
            self._unlink([page_hash])
            return None
        if indexed:
            try:
                os.utime(path)  # recency survives a restart
            except OSError:
                pass
        start = _HEADER.size + 4 * self.page_size
        return np.frombuffer(blob, dtype=self.dtype, offset=start, count=self.row_elems)

    def _read_file(self, path: Path) -> tuple[bytearray, str | None]:
        """The file's bytes if it is a regular file of a page's size, else a problem; never
        follows a symlink or blocks on a FIFO. FileNotFoundError if there is none."""
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise
        except OSError as e:
            return bytearray(), "a symlink" if e.errno == errno.ELOOP else f"unreadable ({e})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return bytearray(), "not a regular file"
            if st.st_size != self.file_bytes:
                return bytearray(), (f"{st.st_size} bytes, expected {self.file_bytes} "
                                     f"(truncated or foreign)")
            blob = bytearray(self.file_bytes)
            done = 0
            with memoryview(blob) as view:
                while done < len(blob) and (n := os.readv(fd, [view[done:]])) > 0:
                    done += n
            return (blob if done == len(blob) else blob[:done]), None
        except OSError as e:
            return bytearray(), f"unreadable ({e})"
        finally:
            os.close(fd)

    def _may_adopt_folder_secret(self) -> bool:
        """`_adopt_folder_secret` from a read: a failure is left to the writer."""
        try:
            return self._adopt_folder_secret(restore=False)
        except (OSError, StorageDirError):
            return False

    def may_hold(self, page_hash: bytes) -> bool:
        """Whether a read of the page may find it (queued, indexed, or a file of that name);
        one stat at most."""
        return page_hash in self or os.path.lexists(self._path(page_hash))

    def _forget(self, page_hash: bytes) -> None:
        with self._lock:
            self._files.pop(page_hash, None)

    def _check(self, blob: bytearray, page_hash: bytes, tokens: np.ndarray) -> str | None:
        if len(blob) != self.file_bytes:
            return f"{len(blob)} bytes, expected {self.file_bytes} (truncated or foreign)"
        magic, version, fingerprint, file_hash, page_size, row_bytes = _HEADER.unpack_from(blob)
        if magic != _MAGIC or version != _VERSION:
            return "not a KV page file of this format"
        mac = hmac.new(self._secret.key, memoryview(blob)[:-_MAC_BYTES],
                       hashlib.sha256).digest()
        if not hmac.compare_digest(mac, blob[-_MAC_BYTES:]):
            return _BAD_MAC
        if fingerprint != self.fingerprint or page_size != self.page_size \
                or row_bytes != self.row_bytes:
            return "written for another model, dtype, page size or KV layout"
        if file_hash != page_hash:
            return "its chain hash differs from its name"
        file_tokens = np.frombuffer(blob, dtype="<i4", count=self.page_size,
                                    offset=_HEADER.size)
        if not np.array_equal(file_tokens, tokens):
            return "it holds other tokens"
        return None

    # ---- lifetime --------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every page file of this fingerprint, one by one (`/flush_cache`): never the
        folders or the secret, which other servers may be using. Writing resumes."""
        self.flush()
        with self._lock:
            self._files.clear()
        try:
            entries = list(os.scandir(self.dir))
        except OSError:  # the folder vanished: nothing to delete
            entries = []
        for entry in entries:
            if _hash_of(entry.name) is not None:
                _remove(entry.path)
        self._resume("the cache was flushed")

    def close(self) -> None:
        """Write what is queued, then end the writer thread."""
        self._queue.put(None)
        self._thread.join()
        _LIVE_WRITERS.discard(self._writer)

    def stats(self) -> dict[str, Any]:
        """What `/server_info` reports under tiers.disk."""
        return {"dir": str(self.dir), "writable": self.writable, "durability": self.durability,
                "max_bytes": self.max_bytes, "used_bytes": self.used_bytes(),
                "used_pages": len(self), "queued_pages": self.queued(),
                "evicted_pages": self.evicted_pages, "dropped_pages": self.dropped_pages,
                "skipped_files": self.skipped_files}

    def check(self, scan: bool = False) -> str | None:
        """A broken invariant, or None. `scan` (tests; no other server on the folder, writes
        flushed): every indexed page has its file."""
        with self._lock:
            if len(self._files) > self.max_pages:
                return f"{len(self._files)} pages on disk, above the cap of {self.max_pages}"
            if both := self._pending.keys() & self._files.keys():
                return f"{len(both)} pages both queued and stored"
            indexed = set(self._files) if scan else set()  # idle checks copy nothing
        if scan:
            on_disk = {h for name in os.listdir(self.dir) if (h := _hash_of(name)) is not None}
            if missing := indexed - on_disk:
                return f"{len(missing)} indexed pages have no file"
        return None


def _hash_of(name: str) -> bytes | None:
    """The chain hash a page file's name gives, or None for any other name."""
    match = _PAGE_NAME.fullmatch(name)
    return None if match is None else bytes.fromhex(match[1])


def _orphaned(name: str) -> bool:
    """A temporary whose writer is gone: its process died, or it is this process's and none of
    its live writers made it (a pid reused after a restart). Not for a name of another form."""
    match = _TMP_NAME.fullmatch(name)
    if match is None:
        return False
    pid, writer = int(match[1]), match[2]
    if pid == os.getpid():
        return writer not in _LIVE_WRITERS
    return pid < 2**31 and not pid_alive(pid)


def _remove(path: str | os.PathLike) -> None:
    """Delete a file the tier owns; one gone already is fine, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("KV disk tier: cannot delete %s: %s", path, e)
