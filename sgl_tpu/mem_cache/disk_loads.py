"""Prompt prefixes read from the disk tier into the host tier off the scheduler thread.

    arrival ── start ──► DiskLoad ── a chunk of pages ──► reader thread (DiskTier.read: open,
       (kv_manager.py        ▲                             check the mac; the row copied into
        load_ahead)          │                             a read buffer)
                             └──── advance, every step ◄── done: rows into the host tier,
                                                           the next chunk submitted
    admission: TieredCache.load copies the pages from the host tier into the pool

The request waits, loading (`KVManager.loading`), while the scheduler runs the others; when its
load is over (every page read, or the first page that no valid file holds) it is admitted like
any other, its pages found in the host tier. A page that left the host tier again before the
admission (another load or a demotion pushed it out) is read by the admission, on the scheduler
thread.

Memory: `NUM_BUFFERS` read buffers of a chunk (tiers.py `chunk_pages`) each, shared by every
load; a load whose next chunk finds none free waits for a step. A load is at most as long as
the pool and the host tier hold.

Threads: everything here runs on the scheduler thread but `_read_loop`, one thread that reads
the `DiskRead`s in the order submitted; it only fills a read's buffer and `found`, then sets
`done`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sgl_tpu.mem_cache.disk_tier import DiskTier
from sgl_tpu.mem_cache.host_tier import HostTier

logger = logging.getLogger(__name__)

NUM_BUFFERS = 2


@dataclass(eq=False)
class DiskRead:
    """Pages to read in order on the reader thread, each under the first of its keys that a
    valid file holds, until the first page that none does.

        pages  [(keys to try, tokens)]      rows  [len(pages), row elements]  (filled in order)
        found  the key of each page read, in order: pages[len(found):] were not read
    """

    pages: list[tuple[list[bytes], np.ndarray]]
    rows: np.ndarray
    found: list[bytes] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # set by the scheduler thread: stop at the next page
    seconds: float = 0.0  # the reader's time on it


@dataclass(eq=False)
class DiskLoad:
    """One request's pages to read, in order: those the host tier lacked at the start."""

    pages: list[tuple[list[bytes], np.ndarray]]  # (keys to try, tokens)
    next: int = 0  # the first page not yet submitted
    read: DiskRead | None = None  # the chunk in flight
    buffer: np.ndarray | None = None  # its read buffer


class DiskLoads:
    def __init__(self, host: HostTier, disk: DiskTier, chunk_pages: int,
                 write_through: bool,
                 on_read: Callable[[int, float], None] | None = None) -> None:
        """`on_read(pages, seconds)`: told of every chunk read (on the scheduler thread)."""
        self.host = host
        self.on_read = on_read
        self.disk = disk
        self.chunk_pages = chunk_pages
        self.write_through = write_through
        self._free: list[np.ndarray] = []  # read buffers [chunk_pages, row elements]
        self._num_buffers = 0
        self._cancelled: list[tuple[DiskRead, np.ndarray]] = []  # reads still running
        # keys this module put into the host tier that no load took into the pool yet (a
        # load from the host tier counts them as disk hits)
        self.from_disk: set[bytes] = set()
        self._reads: queue.Queue[DiskRead | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader",
                                        daemon=True)
        self._reader.start()

    def start(self, pages: list[tuple[list[bytes], np.ndarray]]) -> DiskLoad:
        load = DiskLoad(pages)
        self.advance(load)
        return load

    def advance(self, load: DiskLoad) -> bool:
        """Put the chunk read into the host tier and submit the next; True when `load` is
        over."""
        if load.read is not None:
            if not load.read.done.is_set():
                return False
            read, load.read = load.read, None
            self._put_in_host(read)
            if self.on_read is not None and read.found:
                self.on_read(len(read.found), read.seconds)
            self._free.append(load.buffer)
            load.buffer = None
            if len(read.found) < len(read.pages):  # a page no valid file holds: the end
                return True
        if load.next >= len(load.pages):
            return True
        buffer = self._take_buffer()
        if buffer is None:
            return False
        chunk = load.pages[load.next:load.next + len(buffer)]
        load.next += len(chunk)
        load.buffer = buffer
        load.read = DiskRead(chunk, buffer[:len(chunk)])
        self._reads.put(load.read)
        return False

    def cancel(self, load: DiskLoad) -> None:
        """Stop `load` (its request left the queue); its buffer comes back once the page being
        read is done."""
        if load.read is not None:
            load.read.cancelled = True
            self._cancelled.append((load.read, load.buffer))
            load.read = load.buffer = None

    def wait(self, loads: list[DiskLoad], timeout_s: float) -> None:
        """Block until the first chunk in flight of `loads` is read, at most `timeout_s` (the
        scheduler has nothing else to run: better than spinning against the reader)."""
        for load in loads:
            if load.read is not None:
                load.read.done.wait(timeout_s)
                return

    def clear(self) -> None:
        self.from_disk.clear()

    def close(self) -> None:
        """End the reader thread after the reads submitted."""
        self._reads.put(None)
        self._reader.join()

    def _read_loop(self) -> None:
        while (read := self._reads.get()) is not None:
            t0 = time.perf_counter()
            try:
                for (keys, tokens), out in zip(read.pages, read.rows, strict=True):
                    if read.cancelled:
                        break
                    row = key = None
                    for key in keys:
                        if (row := self.disk.read(key, tokens)) is not None:
                            break
                    if row is None:
                        break
                    out[...] = row
                    read.found.append(key)
            except Exception:  # a bug: keep the thread (the load ends where it stopped)
                logger.exception("KV disk tier: reading pages failed")
            finally:
                read.seconds = time.perf_counter() - t0
                read.done.set()

    def _put_in_host(self, read: DiskRead) -> None:
        for key, (_, tokens), row in zip(read.found, read.pages, read.rows, strict=False):
            dropped = self.host.put(key, tokens, row)
            if dropped is not None and not self.write_through:
                self.disk.write(*dropped)
            self.from_disk.add(key)
        if len(self.from_disk) > 2 * self.host.capacity:  # forget those the host dropped
            self.from_disk = {k for k in self.from_disk if k in self.host}

    def _take_buffer(self) -> np.ndarray | None:
        running = []
        for read, buffer in self._cancelled:
            if read.done.is_set():
                self._free.append(buffer)
            else:
                running.append((read, buffer))
        self._cancelled = running
        if self._free:
            return self._free.pop()
        if self._num_buffers < NUM_BUFFERS:
            self._num_buffers += 1
            return np.empty((self.chunk_pages, self.host.rows.shape[1]), self.host.rows.dtype)
        return None
