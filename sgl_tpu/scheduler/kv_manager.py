"""Moves KV pages between the allocator, the radix tree and requests (host side, no JAX).

Every page is exactly one of: free (allocator), owned by the tree, or owned by a request
(`req.pages[req.tree_len // ps:]`). The operations below keep that true:

* `load_ahead`    at arrival: start reading the request's prefix pages that only the disk
                  tier holds into the host tier, on the tier's thread (mem_cache/disk_loads.py);
                  the request is `loading`, not admissible, until `poll_loads` has read them
                  and moved them into the pool, a step's part at a time while others run.
* `admit_prefix`  match the request's cached prefix in the tree and lock it.
* `alloc_pages`   give a request more pages, evicting unlocked tree leaves when short.
* `cache_req`     after a step: insert the request's computed tokens into the tree, free the
                  pages that turned out to duplicate tree pages, and re-lock at the new end.
* `release_req`   at finish or retraction: cache, then unlock and free what the tree did not
                  take.

Retention pins (`retention.py`: open sessions, session hints, `retention_seconds`, tool
pauses): a request that carries a `session_id` is one turn of an agent loop, and the agent's
next turn resends this turn's prompt and output after a tool call. So when such a request
finishes, `release_req(req, retain=True)` pins its whole inserted path, and when it arrives,
`retain_prefix` pins the part of its prompt that is cached, so it is still there once the
request is admitted (admission locks it; a long queue must not let other traffic evict it
first). Every insert carries the request's `priority` (the `priority` eviction policy). Without
any of these, or with a disabled cache, nothing changes.

A hybrid model's sliding-window pool (`mem_cache/swa_pool.py`, `SwaPageAllocator`): every page
a request is given comes with a window page for the local layers. The manager knows which
requests hold KV, so it knows which pages lie in some request's window (`_window_pages`); when
window pages run short it drops those of the other pages (`_reclaim_windows`), and at admission
it uses a cached prefix only as far as its window survived.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.executor.step import SeqStep
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.disk_loads import DiskLoad
from sgl_tpu.mem_cache.radix_cache import RadixCache, check_page_accounting
from sgl_tpu.mem_cache.swa_pool import SwaPageAllocator
from sgl_tpu.mem_cache.tiers import TieredCache
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.retention import Retention
from sgl_tpu.scheduler.sessions import SessionTable

IDLE_LOAD_WAIT_S = 0.005  # with nothing else to run, wait this long for a disk read per step


@dataclass(eq=False)
class PrefixLoad:
    """A prefix on its way from a lower tier (a waiting request's, or a paused program's
    prefetch: prefetch.py): read from disk into the host tier (`disk`, on the tier's thread),
    then moved into the pool (`disk` None), a step's part at a time. Pages the host tier
    dropped meanwhile (the pool's evictions demote others into it) are read from disk again, as
    long as each read moves the pool's match on (`start`: its match at the last read)."""

    key: np.ndarray  # [num_tokens] int32: the prefix's tokens
    namespace: str | None
    disk: DiskLoad | None
    start: int


class KVManager:
    def __init__(self, allocator: PageAllocator, tree: RadixCache,
                 session_retention_s: float = 0.0, tiers: TieredCache | None = None, *,
                 sessions: SessionTable | None = None, max_retention_s: float = 600.0,
                 tool_pause_grace_s: float = 0.0) -> None:
        self.allocator = allocator
        self.tree = tree
        # the requests holding KV (admitted, not yet released), by id: their windows
        self._holders: dict[int, Req] = {}
        self.swa = allocator if isinstance(allocator, SwaPageAllocator) else None
        self.num_window_cut_tokens = 0  # cached tokens computed again: their window was dropped
        if self.swa is not None:
            self.swa.reclaim = self._reclaim_windows
        self.tiers = tiers  # host/disk tiers below the pool (mem_cache/tiers.py), or None
        # by id(req) while the request waits (held, so that its id is not reused)
        self._loads: dict[int, PrefixLoad] = {}
        self.page_size = allocator.page_size
        self.session_retention_s = session_retention_s
        self.sessions = sessions  # open sessions (/open_session), or None
        self.retention = Retention(tree, sessions, session_retention_s=session_retention_s,
                                   max_retention_s=max_retention_s,
                                   tool_pause_grace_s=tool_pause_grace_s)

    @classmethod
    def for_config(cls, config: SchedulerConfig, num_pages: int,
                   tiers: Callable[[RadixCache], TieredCache] | None = None,
                   swa: tuple[int, int] | None = None) -> KVManager:
        """The pool of `num_pages` pages, its tree, open sessions and, where `tiers` builds
        them over the tree, the host/disk tiers below it. `swa`: (sliding window, window
        pages) of a hybrid model's window pool, or None."""
        allocator = (PageAllocator(num_pages, config.page_size) if swa is None
                     else SwaPageAllocator(num_pages, config.page_size, *swa))
        tree = RadixCache(allocator, disable=config.disable_radix_cache,
                          eviction_policy=config.radix_eviction_policy)
        tiered = None if tiers is None else tiers(tree)
        if tiered is not None:
            tree.add_listener(tiered)
        sessions = SessionTable(tree, default_ttl_s=config.session_ttl_s,
                                max_ttl_s=config.max_retention_s)
        return cls(allocator, tree, config.session_retention_s, tiered, sessions=sessions,
                   max_retention_s=config.max_retention_s,
                   tool_pause_grace_s=config.tool_pause_grace_s)

    def flush(self) -> None:
        """Empty the tree and the tiers below it (no request may hold KV)."""
        self.tree.reset()
        if self.tiers is not None:
            self.tiers.clear()

    # ---- capacity ------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_usable_pages * self.page_size

    def available_pages(self) -> int:
        """Free pages plus what eviction could free right now (and as many window pages:
        all but the ones in some request's window)."""
        main = self.allocator.num_free_pages + self.tree.evictable_size() // self.page_size
        if self.swa is None:
            return main
        needed = np.count_nonzero(self.swa.window_of[self._window_pages()])
        return min(main, self.swa.windows.num_usable_pages - needed)

    def pages_needed(self, req: Req, num_tokens: int) -> int:
        """More pages `req` needs to hold `num_tokens` tokens of KV."""
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def memory_info(self) -> dict[str, int]:
        """Where the pool's pages are and what the tree holds (`/server_info`'s "memory")."""
        alloc, tree = self.allocator, self.tree
        return {
            "num_pages_total": alloc.num_usable_pages,
            "num_pages_free": alloc.num_free_pages,
            "num_pages_tree": tree.num_pages_held(),
            "num_pages_requests": alloc.num_usable_pages - alloc.num_free_pages
                                  - tree.num_pages_held(),
            "tree_evictable_tokens": tree.evictable_size(),
            "tree_protected_tokens": tree.protected_size(),
            "tree_retained_tokens": tree.retained_size(),
            "evicted_tokens": tree.num_evicted_tokens,
            "evicted_retained_tokens": tree.num_evicted_retained_tokens,
            "page_size": self.page_size,
            "max_total_tokens": self.capacity_tokens,
            **({} if self.swa is None else {"swa": {
                **self.swa.info(), "num_window_cut_tokens": self.num_window_cut_tokens}}),
        }

    # ---- admission -----------------------------------------------------------------------
    def admit_prefix(self, req: Req) -> None:
        """Lock the longest cached prefix of `req` (capped by `req.max_prefix_len`), loading
        into the pool what the lower tiers hold beyond the device match."""
        assert req.last_node is None and not req.pages, "request already holds KV"
        ps = self.page_size
        key = req.fill_ids[: req.max_prefix_len]
        match = self.tree.match_prefix(key, req.cache_namespace)
        if self.tiers is not None:  # what follows the match in the host or disk tier
            match = self.tiers.load(np.asarray(key, dtype=np.int32), match)
        prefix_len = match.prefix_len // ps * ps
        if self.swa is not None:  # only as far as the window before it survived
            usable = self.swa.usable_prefix(self.allocator.slots_to_pages(match.slots),
                                            prefix_len)
            if usable < prefix_len:
                match = self.tree.match_prefix(key[:usable], req.cache_namespace)
                self.num_window_cut_tokens += prefix_len - usable
                prefix_len = usable
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.pages = self.allocator.slots_to_pages(match.slots).tolist()
        req.kv_len = req.tree_len = prefix_len
        self._holders[id(req)] = req

    def load_ahead(self, req: Req) -> None:
        """A request arrived: start reading the pages of its prefix that only the disk tier
        holds (it is `loading` until they are in the host tier). One of a session also loads
        its prefix from the host tier into the pool now, not when its turn to run comes
        (`retain_prefix` then keeps it in the pool until admission)."""
        if self.tiers is None:
            return
        key = np.asarray(req.fill_ids[: req.max_prefix_len], dtype=np.int32)
        match = self.tree.match_prefix(key, req.cache_namespace)
        if req.session_id is not None:
            match = self.tiers.load(key, match, from_disk=False)
        if not self.tiers.worth_loading(self.tiers.pages_below(key, match)):
            return
        load = self.tiers.start_disk_load(key, match)
        if load is not None:
            self._loads[id(req)] = PrefixLoad(key, req.cache_namespace, load, match.prefix_len)

    def loading(self, req: Req) -> bool:
        """Whether `req`'s prefix is still loading from disk (not admissible yet)."""
        return id(req) in self._loads

    def poll_loads(self, waiting: list[Req], busy: bool) -> None:
        """Move the loads on: a disk load whose reads are over moves its pages from the host
        tier into the pool, a step's part at a time while others run (`busy`); a request whose
        load is over may be admitted; the load of one no longer waiting (aborted, failed) is
        cancelled. Not `busy` (nothing runs) and every waiting request reading from disk:
        first wait a moment for a read instead of spinning."""
        if not self._loads:
            return
        reads = [load.disk for load in self._loads.values() if load.disk is not None]
        if not busy and len(reads) == len(self._loads) and all(map(self.loading, waiting)):
            self.tiers.wait_disk_loads(reads, IDLE_LOAD_WAIT_S)
        waiting_ids = {id(r) for r in waiting}
        moved = False  # one request's pages move into the pool per step
        for key, load in list(self._loads.items()):
            if key not in waiting_ids:
                if load.disk is not None:
                    self.tiers.cancel_disk_load(load.disk)
                del self._loads[key]
            elif load.disk is not None:
                if self.tiers.advance_disk_load(load.disk):
                    load.disk = None
            elif not busy:
                del self._loads[key]  # nothing to keep smooth: admission loads the rest
            elif not moved:
                moved = True
                if not self.load_step(load):
                    del self._loads[key]

    def has_loads(self) -> bool:
        """Whether a waiting request's prefix is loading (it goes before any prefetch)."""
        return bool(self._loads)

    def load_step(self, load: PrefixLoad) -> bool:
        """Move a step's part of `load`'s prefix from the host tier into the pool, or start
        reading again what the host tier dropped; False when nothing more can move (admission's
        `load` takes whatever is left). The pages moved are cached like any prefix: if evicted
        before admission, admission loads them again."""
        match, more = self.tiers.load_step(
            load.key, self.tree.match_prefix(load.key, load.namespace))
        if more:
            return True
        if match.prefix_len <= load.start:
            return False
        load.disk = (self.tiers.start_disk_load(load.key, match)
                     if self.tiers.worth_loading(self.tiers.pages_below(load.key, match))
                     else None)
        load.start = match.prefix_len
        return load.disk is not None

    def retain_prefix(self, req: Req) -> None:
        """A request with retention arrived: keep its cached prefix until it is admitted."""
        if not self.retention.wants_pins(req):
            return
        match = self.tree.match_prefix(req.fill_ids[: req.max_prefix_len], req.cache_namespace)
        self.retention.on_arrival(req, match.last_node)

    def alloc_pages(self, req: Req, num_pages: int) -> bool:
        """Append `num_pages` fresh pages to `req`, evicting tree leaves if needed."""
        if num_pages <= 0:
            return True
        short = num_pages - self.allocator.num_free_pages
        if short > 0:
            self.tree.evict(short * self.page_size)
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            return False
        req.pages.extend(pages.tolist())
        return True

    # ---- caching / release -----------------------------------------------------------------
    def cache_req(self, req: Req) -> None:
        """Share `req`'s computed KV through the tree while it keeps running."""
        if self.tree.disable:
            return
        aligned, _ = self._insert(req)
        match = self.tree.match_prefix(req.fill_ids[:aligned], req.cache_namespace)
        if match.prefix_len != aligned:
            raise RuntimeError(f"tree lost an inserted prefix ({match.prefix_len} != {aligned})")
        req.pages[: aligned // self.page_size] = self.allocator.slots_to_pages(match.slots).tolist()
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.tree_len = aligned

    def release_req(self, req: Req, retain: bool = False) -> None:
        """Give up all of `req`'s KV: the tree keeps what it can, the rest is freed.

        `retain`: the request ended a turn of its session; retain what the tree keeps."""
        ps = self.page_size
        own_start = req.tree_len // ps
        if self.tree.disable:
            taken_end = own_start
        else:
            aligned, _ = self._insert(req)
            taken_end = aligned // ps
            if retain and self.retention.wants_pins(req):
                key = req.fill_ids[:aligned]
                # (ends exactly at `aligned`)
                end = self.tree.peek_prefix(lambda: key, namespace=req.cache_namespace).node
                self.retention.on_turn_end(req, end)
        self._drop(req, taken_end)

    def discard_req(self, req: Req) -> None:
        """Give up all of `req`'s KV without caching any of it (after a fault its content is
        not trusted): free the pages it owns, unlock the tree prefix it used."""
        self._drop(req, req.tree_len // self.page_size)

    def _drop(self, req: Req, tree_pages: int) -> None:
        """Free `req`'s pages from `tree_pages` on (the ones before belong to the tree), unlock
        its tree path and reset its KV state."""
        to_free = req.pages[tree_pages:]
        if to_free:
            self.allocator.free(np.asarray(to_free, np.int32))
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.pages = []
        req.last_node = None
        req.kv_len = req.tree_len = 0
        self._holders.pop(id(req), None)

    def _insert(self, req: Req) -> tuple[int, int]:
        """Insert req's computed tokens; free its duplicate pages. Returns (aligned, prefix)."""
        ps = self.page_size
        key = req.fill_ids[: req.kv_len]
        slots = self.allocator.pages_to_slots(req.pages, req.kv_len)
        prefix_len = self.tree.insert(key, slots, priority=req.priority,
                                      namespace=req.cache_namespace)
        aligned = req.kv_len // ps * ps
        dup = req.pages[req.tree_len // ps : prefix_len // ps]
        if dup:
            if self.swa is not None:  # the tree's copies may have lost their window pages
                kept = self.tree.match_prefix(key[:prefix_len], req.cache_namespace).slots[
                    req.tree_len :: ps] // ps
                self.swa.adopt(kept, dup)
            self.allocator.free(np.asarray(dup, np.int32))
        return aligned, prefix_len

    # ---- invariants ------------------------------------------------------------------------
    @staticmethod
    def owned_pages(req: Req, page_size: int) -> int:
        return len(req.pages) - req.tree_len // page_size

    def check(self, reqs_holding_kv: list[Req]) -> None:
        """Page accounting + tree integrity; raises RuntimeError on a leak or double use."""
        held = sum(self.owned_pages(r, self.page_size) for r in reqs_holding_kv)
        check_page_accounting(self.allocator, self.tree, held)
        self.tree.check_integrity()
        if self.tiers is not None:
            self.tiers.check()
        if self.swa is not None:
            self.swa.check()
            if not self.swa.window_of[self._window_pages()].all():
                raise RuntimeError("a page in a running request's window lost its window page")

    # ---- the sliding-window pool -------------------------------------------------------------
    def with_windows(self, steps: list[SeqStep]) -> list[SeqStep]:
        """`steps` with the window page of each of their pages (`SeqStep.swa_pages`), as the
        pool maps them now."""
        if self.swa is not None:
            for st in steps:
                st.swa_pages = self.swa.window_of[np.asarray(st.pages, np.int64)]
        return steps

    def _window_pages(self) -> np.ndarray:
        """The pages the requests holding KV read in their local layers from now on."""
        parts = [req.pages[self.swa.first_window_page(req.kv_len):]
                 for req in self._holders.values()]
        return np.fromiter((p for part in parts for p in part), np.int64)

    def _reclaim_windows(self, short: int) -> None:
        """Drop the window pages of at least `short` pages no request's window covers (a
        sixteenth of the window pool at a time, so this runs rarely): first pages no tree node
        holds, then the tree's by node age, keeping each node's last window (where a later
        prompt's match most likely ends) until the rest is gone."""
        swa = self.swa
        held = np.flatnonzero(swa.window_of)
        candidates = np.setdiff1d(held, self._window_pages())
        if not candidates.size:
            return
        tail_pages = -(-swa.window // self.page_size) + 1
        rank = np.zeros(self.allocator.num_pages, np.int64)  # pages no node holds: 0
        for node in self.tree.nodes():
            pages = node.value[:: self.page_size] // self.page_size
            rank[pages] = 2 * node.last_access_time + 1
            rank[pages[-tail_pages:]] += 2**40  # a node's last window after every other page
        order = candidates[np.argsort(rank[candidates], kind="stable")]
        swa.drop_windows(order[: max(short, swa.windows.num_usable_pages // 16)])
