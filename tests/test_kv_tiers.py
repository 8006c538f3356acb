"""KV cache tiers below the pool (mem_cache/tiers.py, host_tier.py, disk_tier.py): content kept
exactly through demotion, loading and restarts, and through the disk's faults (a full disk, a
foreign owner, planted files, a crash mid-write); integrity of every tier; bad files skipped; a
failing disk degrades to the host tier; the runners' page copies; a real server that serves an
evicted prefix from host memory, then from disk after a restart; and two servers sharing one
disk folder while one flushes. tests/test_disk_tier.py tests each disk fault on its own."""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sgl_tpu.backends.torch import kv_pages as torch_kv_pages
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.disk_folder import StorageDirError
from sgl_tpu.mem_cache.disk_tier import DiskTier
from sgl_tpu.mem_cache.host_tier import HostTier
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, chain_hashes
from sgl_tpu.mem_cache.radix_cache import RadixCache, check_page_accounting
from sgl_tpu.mem_cache.tiers import TieredCache, model_fingerprint

ROW_ELEMS = 8  # int16 per page row in the numpy pool
FINGERPRINT = bytes(range(16))


class NumpyPool:
    """A KV pool in host memory: the runner's page-copy methods over a numpy array."""

    def __init__(self, num_pages: int) -> None:
        self.rows = np.zeros((num_pages, ROW_ELEMS), dtype=np.int16)

    def read_kv_pages(self, pages, out=None):
        rows = self.rows[np.asarray(pages)]
        if out is None:
            return rows
        out[...] = rows
        return out

    def write_kv_pages(self, pages, rows) -> None:
        self.rows[np.asarray(pages)] = rows


def content(page_hash: bytes) -> np.ndarray:
    """What "computing" a page writes: a function of its tokens and everything before them."""
    return np.frombuffer(hashlib.blake2b(page_hash, digest_size=2 * ROW_ELEMS).digest(),
                         dtype=np.int16)


def expected_rows(key: list[int], num_tokens: int, page_size: int) -> np.ndarray:
    hashes = chain_hashes(ROOT_HASH, np.asarray(key[:num_tokens], np.int32), page_size)
    return np.stack([content(h.tobytes()) for h in hashes]) if len(hashes) else \
        np.zeros((0, ROW_ELEMS), np.int16)


class Server:
    """One life of a server: a pool, a tree and its tiers (the disk folder outlives it)."""

    def __init__(self, page_size: int, host_pages: int, policy: str, disk_dir: Path | None,
                 chunk_pages: int = 0, **disk_kw):
        self.ps = page_size
        self.allocator = PageAllocator(num_pages=10, page_size=page_size)
        self.pool = NumpyPool(10)
        self.tree = RadixCache(self.allocator)
        disk = None if disk_dir is None else DiskTier(disk_dir, FINGERPRINT, page_size,
                                                      ROW_ELEMS, np.int16,
                                                      **{"max_bytes": 1 << 30, **disk_kw})
        self.tiers = TieredCache(self.pool, self.tree, HostTier(host_pages, ROW_ELEMS, np.int16),
                                 disk, policy, chunk_pages=chunk_pages)
        self.tree.add_listener(self.tiers)

    def run(self, key: list[int]) -> int:
        """Admit, "compute" and finish a request as KVManager does; return its cached length
        (device match plus what the tiers loaded), after checking the cached pages' content."""
        ps = self.ps
        key_arr = np.asarray(key, np.int32)
        match = self.load(key_arr)
        cached = match.prefix_len
        pages = self.allocator.slots_to_pages(match.slots)
        np.testing.assert_array_equal(self.pool.rows[pages], expected_rows(key, cached, ps))
        self.tree.inc_lock_ref(match.last_node)
        new = len(key) // ps - cached // ps
        if new > self.allocator.num_free_pages:
            self.tree.evict((new - self.allocator.num_free_pages) * ps)
        fresh = self.allocator.alloc(new)
        if fresh is None:  # the pool is too small for this request: it does not run
            self.tree.dec_lock_ref(match.last_node)
            return cached
        self.pool.rows[fresh] = expected_rows(key, len(key) // ps * ps, ps)[cached // ps:]
        slots = np.concatenate([match.slots,
                                self.allocator.pages_to_slots(fresh, len(fresh) * ps)])
        self.tree.insert(key_arr[:len(slots)], slots)
        self.tree.dec_lock_ref(match.last_node)
        return cached

    def load(self, key: np.ndarray):
        """KVManager's loads: from disk into the host tier at arrival (waited for here), then
        into the pool at admission (from the host tier, and from disk what left the host tier
        meanwhile); the new match."""
        disk_load = self.tiers.start_disk_load(key, self.tree.match_prefix(key))
        if disk_load is not None:
            while not self.tiers.advance_disk_load(disk_load):
                self.tiers.wait_disk_loads([disk_load], 1.0)
        return self.tiers.load(key, self.tree.match_prefix(key))

    def check(self) -> None:
        self.tree.check_integrity()
        self.tiers.check(deep=True)
        check_page_accounting(self.allocator, self.tree, held_by_requests=0)


BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 6, 6, 7, 7, 8, 8])
FOREIGN_UID = 12345


@functools.cache
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class TierMachine(RuleBasedStateMachine):
    """Random requests, evictions, flushes and restarts, and the disk's faults: full, owned by
    another user, a planted page, a crash mid-write. Every cached page's content must be what
    computing it would write (nothing planted is served), every tier's bookkeeping must hold,
    and the disk holds no more than its cap, every page it indexes in a file."""

    @initialize(page_size=st.sampled_from([1, 2]), host_pages=st.sampled_from([2, 5, 20]),
                policy=st.sampled_from(["write_through", "write_back"]),
                with_disk=st.booleans(), cap_pages=st.sampled_from([2, 5, 1000]),
                chunk_pages=st.sampled_from([0, 1, 3]))
    def setup(self, page_size, host_pages, policy, with_disk, cap_pages, chunk_pages):
        self.dir = Path(tempfile.mkdtemp(prefix="kv_tiers_")) if with_disk else None
        self.now = 0.0  # the disk tier's clock (its back-off)
        self.full = False
        self.planted: set[str] = set()
        self.probes = 0
        file_bytes = 56 + 4 * page_size + 2 * ROW_ELEMS + 32
        self.disk_kw = {"max_bytes": cap_pages * file_bytes, "clock": lambda: self.now}
        self.args = (page_size, host_pages, policy, self.dir, chunk_pages)
        self.start()
        self.attacker = None
        if with_disk:  # a tier of its own secret, writing forged pages to plant
            self.attacker = DiskTier(self.dir / "attacker", FINGERPRINT, page_size, ROW_ELEMS,
                                     np.int16, max_bytes=1 << 20)

    def start(self) -> None:
        self.server = Server(*self.args, **self.disk_kw)
        disk = self.server.tiers.disk
        if disk is not None:  # a disk that is full while `self.full`
            real = disk._write_file

            def write_file(*args):
                if self.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*args)

            disk._write_file = write_file

    def teardown(self):
        if getattr(self, "server", None) is not None and self.server.tiers.disk is not None:
            self.server.tiers.close()
        if getattr(self, "attacker", None) is not None:
            self.attacker.close()
        if getattr(self, "dir", None) is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 8),
          tail=st.lists(st.integers(10, 12), max_size=6))
    def request(self, base, cut, tail):
        key = BASES[base][:cut] + tail
        first = self.server.run(key)
        # the same prompt again is cached up to its last whole page if the first run fit the
        # pool (it then stored every whole page); else at least as far as the first run was
        # (its prefix stayed locked while it tried), in whole pages that fit
        again = self.server.run(key)
        ps = self.server.ps
        whole = len(key) // ps * ps
        usable = self.server.allocator.num_usable_pages * ps
        if whole <= usable:
            assert again == whole
        else:
            assert first <= again <= usable and again % ps == 0

    @rule(num_tokens=st.integers(1, 12))
    def evict(self, num_tokens):
        self.server.tree.evict(num_tokens)

    @rule()
    def flush(self):
        self.server.tree.reset()
        self.server.tiers.clear()
        assert len(self.server.tiers.host) == 0
        if self.server.tiers.disk is not None:
            assert len(self.server.tiers.disk) == 0
            assert self.server.tiers.disk.writable  # a flush turns writing back on

    @rule()
    def restart(self):
        """A new process: empty pool and host tier; the disk folder stays."""
        if self.server.tiers.disk is not None:
            self.server.tiers.close()  # (a stop writes what is queued)
        self.start()

    def _probe(self) -> bytes:
        """Offer the disk a page no request looks up; its hash."""
        self.probes += 1
        page_hash = (10**6 + self.probes).to_bytes(16, "little")
        ps = self.server.ps
        self.server.tiers.disk.write(page_hash, np.zeros(ps, np.int32),
                                     np.zeros(ROW_ELEMS, np.int16))
        self.server.tiers.disk.flush()
        return page_hash

    @precondition(lambda self: self.dir is not None)
    @rule()
    def disk_full(self):
        self.full = True
        self._probe()
        assert not self.server.tiers.disk.writable

    @precondition(lambda self: self.dir is not None and self.full)
    @rule()
    def space_freed(self):
        self.full = False
        self.now += 100.0  # past any back-off
        assert self._probe() in self.server.tiers.disk
        assert self.server.tiers.disk.writable

    @precondition(lambda self: self.dir is not None and os.geteuid() == 0)
    @rule()
    def foreign_owner(self):
        os.chown(self.dir, FOREIGN_UID, -1)
        try:
            with pytest.raises(StorageDirError, match=f"{self.dir} is owned by uid"):
                Server(*self.args, **self.disk_kw)
        finally:
            os.chown(self.dir, os.geteuid(), -1)

    @precondition(lambda self: self.dir is not None)
    @rule(base=st.integers(0, len(BASES) - 1), num_pages=st.integers(1, 4))
    def plant(self, base, num_pages):
        """Another user's page (signed with another secret, its row forged) under the name of a
        page that requests look up."""
        ps = self.server.ps
        key = np.asarray(BASES[base][:num_pages * ps], np.int32)
        page_hash = chain_hashes(ROOT_HASH, key, ps)[-1].tobytes()
        forged = content(page_hash) + 1
        self.attacker.write(page_hash, key[-ps:], forged)
        self.attacker.flush()
        name = page_hash.hex() + ".kv"
        shutil.copy(self.attacker.dir / name, self.server.tiers.disk.dir / name)
        self.planted.add(name)

    @precondition(lambda self: self.dir is not None)
    @rule()
    def crash_mid_write(self):
        """The process dies while writing: its temporary is left, and a page file renamed
        without fsync is torn by a power loss. The next start deletes both."""
        disk = self.server.tiers.disk
        disk.flush()
        orphan = disk.dir / f"{'ab' * 16}.{dead_pid()}-0badcafe.tmp"
        orphan.write_bytes(b"half a page")
        torn = next(iter(sorted(disk.dir.glob("*.kv"))), None)
        if torn is not None:
            torn.write_bytes(torn.read_bytes()[:disk.file_bytes // 2])
        self.server.tiers.close()
        self.start()
        assert not orphan.exists()
        assert torn is None or not torn.exists()

    @invariant()
    def consistent(self):
        if hasattr(self, "server"):
            self.server.check()

    @invariant()
    def disk_within_cap(self):
        if not hasattr(self, "server") or self.server.tiers.disk is None:
            return
        disk = self.server.tiers.disk
        disk.flush()
        assert disk.check(scan=True) is None  # at most the cap; every indexed page a file
        on_disk = {p.name for p in disk.dir.glob("*.kv")}
        indexed = {h.hex() + ".kv" for h in disk._files}
        assert on_disk - indexed <= self.planted  # any other file is the tier's own
        assert len(on_disk & indexed) * disk.file_bytes <= disk.max_bytes


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_evicted_prefix_is_loaded_from_host_then_disk(tmp_path):
    server = Server(page_size=2, host_pages=3, policy="write_back", disk_dir=tmp_path)
    key = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert server.run(key) == 0
    server.tree.evict(100)  # all 4 pages demote to host; host keeps 3, drops one to disk
    assert server.tree.total_size() == 0
    server.tiers.disk.flush()
    assert len(server.tiers.host) == 3 and len(server.tiers.disk) == 1
    # the disk load reads page 0 into the full host tier, which drops page 1 to disk (the
    # least recent): the admission reads that one from disk
    assert server.run(key) == 8
    info = server.tiers.info()
    assert info["host"]["hit_tokens"] == 4 and info["disk"]["hit_tokens"] == 4
    server.check()


@pytest.mark.parametrize("chunk_pages", [1, 3, 4])
def test_a_long_prefix_loads_in_chunks_through_a_bounded_buffer(tmp_path, chunk_pages):
    """8 pages from the host tier, then from disk after a restart, at most `chunk_pages` rows
    copied at once; the pool (9 pages) takes the loaded chunks and the request's own page."""
    first = Server(page_size=2, host_pages=20, policy="write_through", disk_dir=tmp_path,
                   chunk_pages=chunk_pages)
    key = list(range(1, 18))
    assert first.run(key) == 0
    first.tree.evict(100)
    assert first.run(key) == 16 and first.tiers.info()["host"]["hit_tokens"] == 16
    first.check()
    first.tiers.close()
    second = Server(page_size=2, host_pages=20, policy="write_through", disk_dir=tmp_path,
                    chunk_pages=chunk_pages)
    assert second.run(key) == 16 and second.tiers.info()["disk"]["hit_tokens"] == 16
    second.check()
    for tiers in (first.tiers, second.tiers):
        assert len(tiers._load_buf) <= chunk_pages and len(tiers._demote_buf) <= chunk_pages
    second.tiers.close()


def test_a_load_stops_where_the_pool_is_full():
    """The chunks load while pages can be freed, the loaded ones stay (locked while the next
    chunk evicts), and the load ends where the pool is full."""
    server = Server(page_size=1, host_pages=20, policy="write_through", disk_dir=None,
                    chunk_pages=2)
    key = np.arange(1, 9, dtype=np.int32)
    server.run(key.tolist())
    server.tree.evict(100)  # 8 pages in the host tier
    other = np.asarray([50, 51, 52, 53], np.int32)
    server.run(other.tolist())
    held = server.tree.match_prefix(other).last_node
    server.tree.inc_lock_ref(held)  # a running request's 4 pages: 5 left
    match = server.tiers.load(key, server.tree.match_prefix(key))
    assert match.prefix_len == 5 and server.allocator.num_free_pages == 0
    np.testing.assert_array_equal(server.pool.rows[server.allocator.slots_to_pages(match.slots)],
                                  expected_rows(key.tolist(), 5, 1))
    server.tree.dec_lock_ref(held)
    server.check()


def test_restart_finds_prefixes_on_disk(tmp_path):
    first = Server(page_size=2, host_pages=8, policy="write_through", disk_dir=tmp_path)
    key = list(range(1, 12))
    first.run(key)
    first.tiers.close()
    second = Server(page_size=2, host_pages=8, policy="write_through", disk_dir=tmp_path)
    assert second.run(key) == 10  # every whole page, checked against its content
    assert second.tiers.info()["disk"]["hit_tokens"] == 10


def _page_files(server: Server) -> list[Path]:
    return sorted(server.tiers.disk.dir.glob("*.kv"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_bad_disk_files_are_skipped_with_a_warning(tmp_path, caplog, damage):
    first = Server(page_size=2, host_pages=8, policy="write_through", disk_dir=tmp_path)
    key = [3, 1, 4, 1, 5, 9, 2, 6]
    first.run(key)
    first.tiers.close()
    hashes = chain_hashes(ROOT_HASH, np.asarray(key, np.int32), 2)
    bad = first.tiers.disk.dir / (hashes[2].tobytes().hex() + ".kv")  # the third page
    blob = bytearray(bad.read_bytes())
    if damage == "truncate":
        blob = blob[:-3]
    elif damage == "flip":
        blob[-1] ^= 0xFF
    else:  # a file of another model under the expected name
        blob[12:28] = bytes(16)
    bad.write_bytes(bytes(blob))
    second = Server(page_size=2, host_pages=8, policy="write_through", disk_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        assert second.run(key) == 4  # the two pages before the bad one; never the bad one
    assert "skipping" in caplog.text
    assert second.tiers.info()["disk"]["skipped_files"] == 1
    second.check()


def test_a_failing_disk_degrades_to_the_host_tier(tmp_path, caplog):
    server = Server(page_size=2, host_pages=8, policy="write_through", disk_dir=tmp_path)
    folder = server.tiers.disk.dir
    shutil.rmtree(folder)
    folder.write_bytes(b"")  # the folder is now a file: every write fails
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        server.run([1, 2, 3, 4, 5, 6])
        server.tiers.disk.flush()
    assert not server.tiers.disk.writable
    assert "host tier only" in caplog.text
    assert len(server.tiers.disk) == 0  # nothing half-written is listed
    server.tree.evict(100)
    assert server.run([1, 2, 3, 4, 5, 6]) == 6  # served from the host tier
    server.check()


def test_a_disk_folder_that_cannot_be_made_is_an_os_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        DiskTier(tmp_path / "file" / "kv", FINGERPRINT, 2, ROW_ELEMS, np.int16)


def test_fingerprint_names_the_model_and_the_layout():
    params = {"embed": np.arange(12.0).reshape(3, 4), "layers": [{"wk": np.ones((2, 2))}]}
    base = model_fingerprint("cfg", params, "layout")
    other = {"embed": params["embed"] + 1, "layers": params["layers"]}
    assert model_fingerprint("cfg", params, "layout") == base
    assert model_fingerprint("cfg", other, "layout") != base
    assert model_fingerprint("cfg", params, "other layout") != base
    assert model_fingerprint("other cfg", params, "layout") != base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_torch_page_copies_round_trip(dtype):
    ps, pools = 4, [(torch.randn(64, 3, 8).to(dtype), torch.randn(64, 3, 8).to(dtype))
                    for _ in range(2)]
    rows = torch_kv_pages.read_pages(pools, np.array([3, 5]), ps)
    assert rows.shape == (2, 2 * 2 * ps * 3 * 8) and rows.itemsize == pools[0][0].element_size()
    out = np.empty_like(rows)
    assert torch_kv_pages.read_pages(pools, np.array([3, 5]), ps, out) is out
    np.testing.assert_array_equal(out, rows)
    torch_kv_pages.write_pages(pools, np.array([9, 1]), rows, ps)
    for k, v in pools:
        for t in (k, v):
            assert torch.equal(t[36:40].view(torch.uint8), t[12:16].view(torch.uint8))
            assert torch.equal(t[4:8].view(torch.uint8), t[20:24].view(torch.uint8))


def test_int8_pool_page_rows_are_about_half_of_bfloat16s_and_keep_their_scales():
    """A KVPool's page rows carry each head row's scale: an int8 pool's rows are (d + 2) / 2d
    of a bfloat16 pool's bytes (66 / 128 at the default model's head_dim 64), and rows read
    and written back give the same dequantized K/V."""
    from sgl_tpu.backends.torch.kv_pool import KVPool, load_rows, store_rows
    from sgl_tpu.kv_dtypes import kv_dtype

    ps, kvh, d = 4, 3, 64
    pools = {name: KVPool(kv_dtype(name), [16 * ps] * 2, [False, False], ps, kvh, d,
                          torch.device("cpu")) for name in ("bfloat16", "int8")}
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(3 * ps, 5 * ps)  # pages 3 and 4
    for layer in pools["int8"]:
        for t in layer:
            store_rows(t, slots, torch.randn(len(slots), kvh, d, generator=g))
    rows = {name: pool.read_pages(np.array([3, 4])) for name, pool in pools.items()}
    assert rows["int8"].nbytes * 128 == rows["bfloat16"].nbytes * 66
    assert pools["int8"].nbytes * 128 == pools["bfloat16"].nbytes * 66
    assert "int8" in pools["int8"].page_layout() != pools["bfloat16"].page_layout()
    pools["int8"].write_pages(np.array([9, 1]), rows["int8"])
    moved = torch.cat([torch.arange(9 * ps, 10 * ps), torch.arange(ps, 2 * ps)])
    for k, v in pools["int8"]:
        for t in (k, v):
            assert torch.equal(load_rows(t, moved, torch.float32),
                               load_rows(t, slots, torch.float32))


def test_jax_page_copies_round_trip():
    import jax.numpy as jnp

    from sgl_tpu.backends.jax import kv_pages as jax_kv_pages
    rng = np.random.default_rng(0)
    pools = [tuple(jnp.asarray(rng.standard_normal((3, 16, 4, 8)), dtype=jnp.bfloat16)
                   for _ in range(2)) for _ in range(2)]
    before = [tuple(np.asarray(t) for t in layer) for layer in pools]
    rows = jax_kv_pages.read_pages(pools, np.array([2, 7, 11]))
    assert rows.shape == (3, 2 * 2 * 3 * 4 * 8) and rows.dtype == np.uint16
    pools = jax_kv_pages.write_pages(pools, np.array([5, 6, 1]), rows)
    for (k, v), (k0, v0) in zip(pools, before, strict=True):
        for t, t0 in ((np.asarray(k), k0), (np.asarray(v), v0)):
            np.testing.assert_array_equal(t[:, [5, 6, 1]], t0[:, [2, 7, 11]])
            np.testing.assert_array_equal(t[:, 3], t0[:, 3])  # other pages untouched


# ---- a real server ---------------------------------------------------------------------------
def _generate(server, text: str) -> dict:
    return server.post_ok("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}})


def _wait_written(server, timeout: float = 30.0) -> dict:
    import time
    deadline = time.monotonic() + timeout
    while (info := server.info())["tiers"]["disk"]["queued_pages"]:
        assert time.monotonic() < deadline, "disk writes still queued"
        time.sleep(0.1)
    return info


PROMPT = " ".join(f"Step {i}: the agent read file {i * 7 % 13} and ran test {i}."
                  for i in range(40))


def _tiered_server_flags(storage_dir: Path, *extra: str) -> tuple[str, ...]:
    """A small pool over host and disk tiers, on the default model (skipped without it);
    deterministic, so an answer does not depend on which part of its prompt was cached."""
    from sgl_tpu.loader import default_model_path
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ("--skip-warmup", "--max-total-tokens", "1024", "--max-running-requests", "4",
            "--enable-deterministic-inference", "--enable-hierarchical-cache",
            "--hicache-ratio", "4", "--hicache-storage-backend", "file",
            "--hicache-storage-dir", str(storage_dir), *extra)


def test_server_serves_evicted_prefixes_from_host_then_from_disk_after_a_restart(tmp_path):
    from server_harness import launch_server

    flags = _tiered_server_flags(tmp_path)
    with launch_server(*flags) as server:
        cold = _generate(server, PROMPT)
        prompt_len = cold["meta_info"]["prompt_tokens"]
        assert 600 < prompt_len < 1000
        for i in range(3):  # other agents fill the pool and evict the first prompt
            _generate(server, f"Agent {i} notes. " + PROMPT[::-1])
        info = server.wait_idle()
        assert info["memory"]["evicted_tokens"] >= prompt_len // 2
        warm = _generate(server, PROMPT)
        assert warm["text"] == cold["text"]
        assert warm["meta_info"]["cached_tokens"] >= prompt_len - 16
        info = _wait_written(server)
        assert info["tiers"]["host"]["hit_tokens"] >= prompt_len - 16
        assert info["integrity"] == "ok"
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert 'sglang:hicache_hit_tokens{model_name=' in metrics and 'tier="host"' in metrics
    with launch_server(*flags) as server:
        restarted = _generate(server, PROMPT)
        assert restarted["text"] == cold["text"]
        assert restarted["meta_info"]["cached_tokens"] >= prompt_len - 16
        info = server.wait_idle()
        assert info["tiers"]["disk"]["hit_tokens"] >= prompt_len - 16
        assert info["tiers"]["disk"]["skipped_files"] == 0
        server.post_ok("/flush_cache")
        info = server.info()
        assert info["tiers"]["disk"]["used_pages"] == 0 and info["tiers"]["host"]["used_pages"] == 0
        assert _generate(server, PROMPT)["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow
def test_two_servers_share_a_disk_folder_while_one_flushes(tmp_path):
    """Both store into one folder; the first flushes; the second goes on storing and serving,
    its files removed under it are misses, and the first reads what the second wrote after."""
    from server_harness import launch_server

    flags = _tiered_server_flags(tmp_path, "--hicache-storage-max-bytes", str(2**30))
    prompts = [f"Agent {i} notes. " + PROMPT[: 1200 + 300 * i] for i in range(3)]
    with launch_server(*flags) as first, launch_server(*flags) as second:
        _generate(first, prompts[0])
        answer = _generate(second, prompts[1])
        before = _wait_written(second)["tiers"]["disk"]
        assert before["used_pages"] > 0 and _wait_written(first)["tiers"]["disk"]["used_pages"]
        first.post_ok("/flush_cache")  # every page file of the model, both servers'
        folder = Path(before["dir"])
        assert not list(folder.glob("*.kv")) and (tmp_path / "hicache.key").exists()
        again = _generate(second, prompts[1])  # served from its pool or host tier
        assert again["text"] == answer["text"]
        assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 16
        third = _generate(second, prompts[2])
        after = _wait_written(second)
        disk = after["tiers"]["disk"]
        assert disk["writable"] and disk["skipped_files"] == 0
        assert disk["demote_bytes"] > before["demote_bytes"]  # it went on storing
        assert after["integrity"] == "ok"
        # the flushed server reads the page files the other one wrote since
        read_back = _generate(first, prompts[2])
        assert read_back["text"] == third["text"]
        info = first.wait_idle()
        assert info["tiers"]["disk"]["hit_tokens"] >= third["meta_info"]["prompt_tokens"] - 16
        assert info["tiers"]["disk"]["skipped_files"] == 0 and info["integrity"] == "ok"
        assert info["tiers"]["disk"]["max_bytes"] == 2**30
        assert info["tiers"]["disk"]["durability"] == "none"
