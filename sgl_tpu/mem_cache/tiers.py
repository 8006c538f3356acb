"""Tiers below the KV pool: host memory, then disk (SGLang's HiCache, on one host).

    device pool (radix tree) ──evict: demote──► host tier ──drop: demote──► disk tier
          ▲                                        │                          │
          └────── admission: load back ◄───────────┴──────────────────────────┘

Pages are keyed by chain hash (`page_hash.py`): a page's hash names its tokens and every token
before them, so the tiers need no tree of their own. The device tree tells this module when a
leaf is stored and when it is about to be evicted (`TreeListener`); a request's admission asks
it to load the pages that follow the device match (`load`). Pages only the disk tier holds are
read off the scheduler thread when the request arrives (`start_disk_load`, disk_loads.py), into
the host tier, so that its admission finds them there.

Write policies (`--hicache-write-policy`, SGLang's names):
  write_through  a page is copied to the host tier when the tree stores it (and queued for the
                 disk tier when the host tier takes it): an eviction frees the pool at once,
                 and the disk holds every prefix for a restart.
  write_back     a page is copied to the host tier only when it is evicted from the pool, and
                 to disk only when the host tier drops it: less copying, a cold disk.

A load runs in chunks of at most `chunk_pages` pages (64 MiB of rows), so its row buffer stays
that small however long the prefix: per chunk, it copies the found pages' rows out of the tiers
first, then frees pool pages (an eviction may demote other pages and push host entries out,
never the rows already copied; the chunks loaded before stay locked), writes them into the pool
(`write_kv_pages`) and inserts them into the tree, where the request's admission locks them like
any cached prefix. A demotion copies at most a chunk at a time too. Tiers hold the pool's dtype
as raw bits: an fp8 pool stays fp8. On CPU a load is a memory copy into the pool. On an
accelerator the same copies cross the host link; see docs/kv-cache-tiers.md for the bandwidth
and the overlap with compute.

Under a sliding-window pool (`swa_pool.py`) a row holds the local layers' K/V from the page's
window page. A page whose window page was dropped has only its global layers' K/V: its row is
kept under a key of its own (`global_only_hash`), and a load brings it back without a window
page, so the request's admission uses the prefix only as far as the windows it needs came back
too (in an agent's next turn, the last window of its context: those pages were in the
request's window when it ended, so their rows are whole).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sgl_tpu.mem_cache.disk_loads import DiskLoad, DiskLoads
from sgl_tpu.mem_cache.disk_tier import DiskTier
from sgl_tpu.mem_cache.host_tier import HostTier
from sgl_tpu.mem_cache.load_cost import LoadCost
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, chain_hashes
from sgl_tpu.mem_cache.radix_cache import MatchResult, PrefixPeek, RadixCache
from sgl_tpu.mem_cache.swa_pool import SwaPageAllocator
from sgl_tpu.mem_cache.tree_node import TreeListener, TreeNode

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back")
CHUNK_BYTES = 64 * 2**20  # rows a load or a demotion copies at once
# rows a load from disk moves into the pool per scheduler step while others run (`load_step`):
# on a CPU about a decode step's time, so a running stream's token gaps stay near its idle ones
STEP_BYTES = 8 * 2**20


def global_only_hash(page_hash: bytes) -> bytes:
    """The key of a page's row that lacks its local layers' K/V (its window page was
    dropped): never a chain hash, so the two rows of one page never mix."""
    return hashlib.blake2b(page_hash, digest_size=len(page_hash), person=b"global-only").digest()


class KVPageIO(Protocol):
    """What the tiers need from a runner (the step contract's optional KV-page methods)."""

    def read_kv_pages(self, pages: np.ndarray, out: np.ndarray | None = None, **window: Any
                      ) -> np.ndarray: ...

    def write_kv_pages(self, pages: np.ndarray, rows: np.ndarray, **window: Any) -> None: ...


@dataclass
class TierCounters:
    """What one tier did so far (`/server_info` "tiers", `/metrics`)."""

    hit_tokens: int = 0  # prompt tokens loaded from this tier into the pool
    load_bytes: int = 0
    load_s: float = 0.0
    demote_bytes: int = 0  # written into this tier (from the pool, or from the host tier)
    demote_s: float = 0.0
    skipped_tokens: int = 0  # held here, but computed: fewer than the crossover (load_cost.py)


@dataclass(frozen=True)
class PagesBelow:
    """The pages of a key after its device match that the tiers below hold (`pages_below`)."""

    num_pages: int  # in the host tier or on disk, in a row: what a prefetch may move
    num_host: int  # in the host tier, in a row
    num_disk: int  # then on disk, in a row: with `num_host`, what a load's cost weighs


class TieredCache(TreeListener):
    def __init__(self, io: KVPageIO, tree: RadixCache, host: HostTier,
                 disk: DiskTier | None = None, write_policy: str = "write_through", *,
                 chunk_pages: int = 0, load_cost: LoadCost | None = None) -> None:
        """`chunk_pages`: pages a load or a demotion copies at once (0: `CHUNK_BYTES` of rows).
        `load_cost`: which loads beat computing (default: fitted to what this server sees)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if chunk_pages < 0:
            raise ValueError(f"chunk_pages must be >= 0, got {chunk_pages}")
        self.io = io
        self.tree = tree
        self.allocator = tree.allocator
        self.swa = self.allocator if isinstance(self.allocator, SwaPageAllocator) else None
        self.page_size = tree.page_size
        self.host = host
        self.disk = disk
        self.write_through = write_policy == "write_through"
        self.write_policy = write_policy
        self.host_counters = TierCounters()
        self.disk_counters = TierCounters()
        self.load_cost = load_cost if load_cost is not None else LoadCost()
        self.chunk_pages = chunk_pages or max(1, CHUNK_BYTES // host.row_bytes)
        self.step_pages = min(self.chunk_pages, max(1, STEP_BYTES // host.row_bytes))
        # Row buffers reused by every copy (fresh memory is faulted in page by page, which
        # costs more than the copy), of at most a chunk: one for demotions, one for loads,
        # since a load's eviction demotes while the load's rows wait.
        self._demote_buf = _RowBuffer(host.rows.shape[1], host.rows.dtype, self.chunk_pages)
        self._load_buf = _RowBuffer(host.rows.shape[1], host.rows.dtype, self.chunk_pages)
        self.disk_loads = (None if disk is None else DiskLoads(
            host, disk, self.chunk_pages, self.write_through,
            on_read=lambda pages, s: self.load_cost.observe_disk_read(pages * self.page_size, s)))

    # ---- the tree's events (TreeListener) --------------------------------------------------
    def stored(self, node: TreeNode) -> None:
        if self.write_through:
            self._backup(node)

    def removing(self, node: TreeNode) -> None:
        self._backup(node)

    def _backup(self, node: TreeNode) -> None:
        """Copy `node`'s pages that the host tier lacks into it (refreshing the others)."""
        ps = self.page_size
        all_pages = self.allocator.slots_to_pages(node.value)
        whole = (np.ones(len(all_pages), bool) if self.swa is None
                 else self.swa.window_of[all_pages] > 0)
        # the key of each page's row: global-only rows under keys of their own
        keys = [h.tobytes() if w else global_only_hash(h.tobytes())
                for h, w in zip(node.hashes, whole, strict=True)]
        missing = [i for i, (h, k) in enumerate(zip(node.hashes, keys, strict=True))
                   if self.host.get(h.tobytes()) is None and self.host.get(k) is None]
        if not missing:
            return
        t0 = time.perf_counter()
        for lo in range(0, len(missing), self.chunk_pages):
            chunk = missing[lo:lo + self.chunk_pages]
            pages = all_pages[chunk]
            rows = self.io.read_kv_pages(pages, self._demote_buf.get(len(pages)),
                                         **self._windows(pages))
            for row, i in zip(rows, chunk, strict=True):
                tokens = node.key[i * ps:(i + 1) * ps]
                dropped = self.host.put(keys[i], tokens, row)
                if self.disk is not None:
                    if self.write_through:
                        self.disk.write(keys[i], tokens, row)
                    elif dropped is not None:
                        self.disk.write(*dropped)
        self.host_counters.demote_bytes += len(missing) * self.host.row_bytes
        self.host_counters.demote_s += time.perf_counter() - t0

    # ---- loading back ----------------------------------------------------------------------
    def load(self, key: np.ndarray, match: MatchResult, from_disk: bool = True) -> MatchResult:
        """Load the pages of `key` that follow `match` (the device tree's match of `key`) from
        the lower tiers (`from_disk`: the disk too, read here) into the pool and the tree, as
        many as are found in a row and fit; return the new match (`match` itself when nothing
        was loaded). Nothing is loaded when computing those pages is faster (`load_cost`); an
        admission's load (`from_disk`) counts them as skipped."""
        if not self.worth_loading(self.pages_below(key, match, from_disk),
                                  count_skipped=from_disk):
            return match
        loaded: list[int] = []  # this load's pool pages, in order
        while True:
            new, pages = self._load_chunk(key, match, loaded, from_disk, self.chunk_pages)
            loaded.extend(pages)
            if len(pages) < self.chunk_pages:
                return new
            match = new

    def load_step(self, key: np.ndarray, match: MatchResult) -> tuple[MatchResult, bool]:
        """One scheduler step's part of `load` from the host tier: at most `step_pages` pages
        after `match`; (the new match, whether more may follow). A request whose prefix came
        from disk moves into the pool this way while the others decode, so no step copies the
        whole prefix; its admission's `load` takes what is left. Under a sliding-window pool
        the chunks of one load depend on each other (`_drop_stale_windows`), so there nothing
        moves here."""
        if self.swa is not None:
            return match, False
        new, pages = self._load_chunk(key, match, [], False, self.step_pages)
        return new, len(pages) == self.step_pages

    def _load_chunk(self, key: np.ndarray, match: MatchResult, loaded: list[int],
                    from_disk: bool, max_pages: int) -> tuple[MatchResult, list[int]]:
        """`load` of at most `max_pages` pages (a chunk at most) after the `loaded` ones: the
        new match and the pages loaded."""
        ps = self.page_size
        t0 = time.perf_counter()
        found, whole = self._find(key, match.prefix_len, match.last_node.last_hash(),
                                  max_pages, from_disk)
        if not found:
            return match, []
        self.tree.inc_lock_ref(match.last_node)  # eviction below must not take the match
        try:
            n = min(len(found), self.allocator.num_free_pages
                    + self.tree.evictable_size() // ps)
            short = n - self.allocator.num_free_pages
            if short > 0:
                self.tree.evict(short * ps)
            if self.swa is not None and loaded and n:
                self._drop_stale_windows(loaded, match.prefix_len + n * ps, whole[:n])
            pages = (None if not n else self.allocator.alloc(n) if self.swa is None
                     else self.swa.alloc(n, windows=self._windowed(match.prefix_len, whole[:n])))
        finally:
            self.tree.dec_lock_ref(match.last_node)
        if pages is None:
            return match, []
        self.io.write_kv_pages(pages, self._load_buf.get(n), **self._windows(pages))
        end = match.prefix_len + n * ps
        slots = np.concatenate([match.slots, self.allocator.pages_to_slots(pages, n * ps)])
        namespace = self.tree.namespace_of(match.last_node)
        self.tree.insert(key[:end], slots, namespace=namespace)
        elapsed = time.perf_counter() - t0
        self.load_cost.observe_host_load(n * ps, elapsed)
        for tier, counters in (("host", self.host_counters), ("disk", self.disk_counters)):
            num = found[:n].count(tier)
            counters.hit_tokens += num * ps
            counters.load_bytes += num * self.host.row_bytes
            counters.load_s += elapsed * num / n
        new = self.tree.match_prefix(key[:end], namespace)
        if new.prefix_len != end:
            raise RuntimeError(f"tree lost loaded pages ({new.prefix_len} != {end})")
        return new, pages.tolist()

    def _drop_stale_windows(self, loaded: list[int], end: int, whole: list[bool]) -> None:
        """Before the next chunk (ending at token `end`, its rows whole or not) is loaded:
        drop the window pages the chunks before got (`_windowed` of their own end) that a
        load ending at `end` would not have given, so a chunked load keeps those of a load in
        one piece."""
        if all(whole):  # (else the window before `end` starts in this chunk)
            first = self.swa.first_window_page(end) - (end // self.page_size - len(whole))
            stale = loaded[:max(0, len(loaded) + first)]
        else:
            stale = loaded
        stale_pages = np.asarray(stale, np.int64)
        stale_pages = stale_pages[self.swa.window_of[stale_pages] > 0]
        if stale_pages.size:
            self.swa.drop_windows(stale_pages)

    def _windowed(self, start: int, whole: list[bool]) -> int:
        """How many of the pages loaded after token `start` get window pages: the last ones,
        as far as their rows are whole and they lie in the window before the loaded end (the
        rest load with their global layers' K/V only; their rows' local part goes to window
        page 0, the padding page)."""
        trailing = next((i for i, w in enumerate(reversed(whole)) if not w), len(whole))
        first = self.swa.first_window_page(start + len(whole) * self.page_size)
        return min(trailing, len(whole) - max(first - start // self.page_size, 0))

    def _windows(self, pages: np.ndarray) -> dict[str, np.ndarray]:
        """The runner's `window_pages` argument for `pages` (their window pages), under a
        sliding-window pool."""
        return {} if self.swa is None else {"window_pages": self.swa.window_of[pages]}

    def _find(self, key: np.ndarray, start: int, parent_hash: bytes | None, max_pages: int,
              from_disk: bool) -> tuple[list[str], list[bool]]:
        """The tier of each page of `key` from token `start` on, while found (at most
        `max_pages`), and whether its row is whole (else global-only); their rows are copied,
        in order, into the load buffer."""
        ps = self.page_size
        prev = parent_hash or ROOT_HASH
        tiers: list[str] = []
        whole: list[bool] = []
        first = start // ps
        for p in range(first, min(len(key) // ps, first + max_pages)):
            tokens = np.asarray(key[p * ps:(p + 1) * ps], dtype=np.int32)
            page_hash = chain_hashes(prev, tokens, ps)[0].tobytes()
            for k in self._keys(page_hash):
                row, tier = self._lookup(k, tokens, from_disk)
                if row is not None:
                    break
            if row is None:
                break
            self._load_buf.get(len(tiers) + 1, keep=True)[-1] = row
            tiers.append(tier)
            whole.append(k == page_hash)
            prev = page_hash
        return tiers, whole

    def _keys(self, page_hash: bytes) -> list[bytes]:
        """The keys a page's row may be under, the whole row's first."""
        return [page_hash] if self.swa is None else [page_hash, global_only_hash(page_hash)]

    def _lookup(self, page_key: bytes, tokens: np.ndarray, from_disk: bool
                ) -> tuple[np.ndarray | None, str]:
        """The row under `page_key` in the host tier, else on disk, and where it came from
        (a page a disk load put into the host tier counts as the disk's)."""
        row = self.host.get(page_key)
        if row is None:
            if self.disk is None or not from_disk:
                return None, "host"
            return self.disk.read(page_key, tokens), "disk"
        if self.disk_loads is not None and page_key in self.disk_loads.from_disk:
            self.disk_loads.from_disk.discard(page_key)
            return row, "disk"
        return row, "host"

    def worth_loading(self, below: PagesBelow, count_skipped: bool = False,
                      max_pages: int | None = None) -> bool:
        """Whether the pages a load would take (`below`: host pages, then disk pages, in a row;
        the first `max_pages` of them) load faster than they compute (`load_cost`).
        `count_skipped`: count them as skipped when not."""
        num_host, num_disk = below.num_host, below.num_disk
        if max_pages is not None:
            num_host = min(num_host, max_pages)
            num_disk = min(num_disk, max_pages - num_host)
        ps = self.page_size
        if not num_host + num_disk:
            return False
        if self.load_cost.worth_loading(num_host * ps, num_disk * ps):
            return True
        if count_skipped:
            self.host_counters.skipped_tokens += num_host * ps
            self.disk_counters.skipped_tokens += num_disk * ps
        return False

    def pages_below(self, key: np.ndarray, match: MatchResult | PrefixPeek,
                    from_disk: bool = True) -> PagesBelow:
        """The pages of `key` after `match` (the device tree's match of `key`, or a peek at it)
        that the host tier holds, or (`from_disk`) the disk tier may hold; nothing is read."""
        ps = self.page_size
        node, node_len = ((match.last_node, match.prefix_len) if isinstance(match, MatchResult)
                          else (match.node, match.node_len))
        prev = node.last_hash() or ROOT_HASH
        disk = self.disk if from_disk else None
        num_pages = num_host = num_disk = 0
        in_row = True  # host pages, then disk pages, so far
        for p in range(node_len // ps, len(key) // ps):
            tokens = np.asarray(key[p * ps:(p + 1) * ps], dtype=np.int32)
            page_hash = chain_hashes(prev, tokens, ps)[0].tobytes()
            prev = page_hash
            if p < match.prefix_len // ps:
                continue  # (a peek ending inside its node's child)
            keys = self._keys(page_hash)
            in_host = any(k in self.host for k in keys)
            # a stat at most per page; none for a host page before the row's disk part
            on_disk = (disk is not None and (not in_host or (in_row and num_disk > 0))
                       and any(map(disk.may_hold, keys)))
            if not (in_host or on_disk):
                break
            if in_row and in_host and not num_disk:
                num_host += 1
            elif in_row and on_disk:
                num_disk += 1
            else:
                in_row = False
            num_pages += 1
        return PagesBelow(num_pages, num_host, num_disk)

    # ---- loads from disk off the scheduler thread (disk_loads.py) ----------------------------
    def start_disk_load(self, key: np.ndarray, match: MatchResult) -> DiskLoad | None:
        """Start reading into the host tier, on the disk tier's thread, the pages of `key`
        after `match` that the host tier lacks (no more than the pool and the host tier hold;
        those it has are refreshed, so that the pages read push other pages out first); None if
        there is no disk tier or the first of them is not on it. Whether loading beats computing
        is the caller's to ask first (`worth_loading`)."""
        if self.disk_loads is None:
            return None
        ps = self.page_size
        prev = match.last_node.last_hash() or ROOT_HASH
        first = match.prefix_len // ps
        end = min(len(key) // ps,
                  first + min(self.allocator.num_usable_pages, self.host.capacity))
        pages: list[tuple[list[bytes], np.ndarray]] = []
        for p in range(first, end):
            tokens = np.asarray(key[p * ps:(p + 1) * ps], dtype=np.int32)
            page_hash = chain_hashes(prev, tokens, ps)[0].tobytes()
            keys = self._keys(page_hash)
            if all(self.host.get(k) is None for k in keys):
                if not pages and not any(self.disk.may_hold(k) for k in keys):
                    return None
                pages.append((keys, tokens))
            prev = page_hash
        return self.disk_loads.start(pages) if pages else None

    def advance_disk_load(self, load: DiskLoad) -> bool:
        """Move `load` on (a step of the scheduler's); True when it is over."""
        return self.disk_loads.advance(load)

    def cancel_disk_load(self, load: DiskLoad) -> None:
        self.disk_loads.cancel(load)

    def wait_disk_loads(self, loads: list[DiskLoad], timeout_s: float) -> None:
        self.disk_loads.wait(loads, timeout_s)

    # ---- lifetime, reports -----------------------------------------------------------------
    def clear(self) -> None:
        """Empty the host and disk tiers (`/flush_cache`)."""
        self.host.clear()
        if self.disk is not None:
            self.disk_loads.clear()
            self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk_loads.close()
            self.disk.close()

    def info(self) -> dict[str, Any]:
        """Per tier: hits, loads, demotions and occupancy (`/server_info` "tiers")."""
        host = {"capacity_pages": self.host.capacity, "used_pages": len(self.host),
                "capacity_bytes": self.host.capacity * self.host.row_bytes,
                **vars(self.host_counters)}
        load_cost = self.load_cost.info()
        host["crossover_tokens"] = load_cost["host_crossover_tokens"]
        out: dict[str, Any] = {"write_policy": self.write_policy, "host": host,
                               "load_cost": load_cost}
        if self.disk is not None:
            disk_counters = dict(vars(self.disk_counters))
            disk_counters["demote_bytes"] = self.disk.write_bytes
            disk_counters["demote_s"] = self.disk.write_s
            out["disk"] = {**self.disk.stats(), **disk_counters,
                           "crossover_tokens": load_cost["disk_crossover_tokens"]}
        return out

    def check(self, deep: bool = False) -> None:
        """RuntimeError on a broken tier invariant. `deep` (tests): every tree page the host
        tier also holds has the same content in both."""
        if (problem := self.host.check()) is not None:
            raise RuntimeError(problem)
        if self.disk is not None and (problem := self.disk.check()) is not None:
            raise RuntimeError(problem)
        if not deep:
            return
        for node in self.tree._walk():
            if node.is_root:
                continue
            pages = self.allocator.slots_to_pages(node.value)
            for i, h in enumerate(node.hashes):
                row = self.host.get(h.tobytes())
                if self.swa is not None and not self.swa.window_of[pages[i]]:
                    continue  # (its local layers' K/V is no longer in the pool)
                if row is not None and not np.array_equal(
                        row, self.io.read_kv_pages(pages[i:i + 1],
                                                   **self._windows(pages[i:i + 1]))[0]):
                    raise RuntimeError(f"tiers disagree on page {i} of {node!r}")


class _RowBuffer:
    """An array of page rows reused from call to call, grown as needed up to `max_rows`."""

    def __init__(self, row_elems: int, dtype: np.dtype, max_rows: int) -> None:
        self._rows = np.empty((0, row_elems), dtype=dtype)
        self.max_rows = max_rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, n: int, keep: bool = False) -> np.ndarray:
        """The first `n` rows (`n` <= `max_rows`); `keep`: rows already there survive a
        growth."""
        if n > self.max_rows:
            raise ValueError(f"{n} rows asked of a buffer of at most {self.max_rows}")
        if n > len(self._rows):
            grown = np.empty((min(max(n, 2 * len(self._rows)), self.max_rows),
                              self._rows.shape[1]), dtype=self._rows.dtype)
            if keep:
                grown[:len(self._rows)] = self._rows
            self._rows = grown
        return self._rows[:n]


def model_fingerprint(model_desc: str, params: Any, layout: str) -> bytes:
    """16 bytes naming what a KV page depends on: the model (its config and a sample of every
    weight), the runner's page layout and dtype. Disk files are kept per fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model_desc.encode())
    h.update(layout.encode())
    for name, array in _arrays(params):
        a = np.asarray(array)
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        flat = a.reshape(-1)
        h.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).tobytes())
    return h.digest()


def _arrays(params: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(params, dict):
        for k in sorted(params):
            yield from _arrays(params[k], f"{prefix}/{k}")
    elif isinstance(params, list | tuple):
        for i, v in enumerate(params):
            yield from _arrays(v, f"{prefix}/{i}")
    elif params is not None:
        yield prefix, params
