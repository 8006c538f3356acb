"""Prefixes read from the disk tier off the scheduler thread (mem_cache/disk_loads.py): the reads
run on the tier's reader thread into bounded buffers and the host tier, a load ends at the first
page missing on disk, a cancelled load gives its buffer back, and through the scheduler a
request waits, loading, while another keeps decoding, then joins with its prefix cached."""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
from test_kv_tiers import FINGERPRINT, ROW_ELEMS, NumpyPool, Server
from test_scheduler import PAGE, PlusOneRunner, V, expected, request, run_steps

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.mem_cache.disk_loads import NUM_BUFFERS
from sgl_tpu.mem_cache.disk_tier import DiskTier
from sgl_tpu.mem_cache.host_tier import HostTier
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, chain_hashes
from sgl_tpu.mem_cache.tiers import TieredCache

KEY = list(range(1, 18))  # 8 whole pages of 2 tokens
READER = "kv-disk-reader"


def restarted(tmp_path, chunk_pages: int = 3) -> Server:
    """A server whose disk tier holds KEY's pages from its previous life; nothing else."""
    first = Server(page_size=2, host_pages=20, policy="write_through", disk_dir=tmp_path,
                   chunk_pages=chunk_pages)
    first.run(KEY)
    first.tiers.close()
    return Server(page_size=2, host_pages=20, policy="write_through", disk_dir=tmp_path,
                  chunk_pages=chunk_pages)


def record_reads(disk: DiskTier, monkeypatch, gate: threading.Event | None = None
                 ) -> list[str]:
    """The thread of every page file read from now on; reads wait for `gate` if given."""
    threads: list[str] = []
    real = disk._read_file

    def read_file(path):
        threads.append(threading.current_thread().name)
        if gate is not None:
            gate.wait(10)
        return real(path)

    monkeypatch.setattr(disk, "_read_file", read_file)
    return threads


def start(server: Server, key: list[int]):
    k = np.asarray(key, np.int32)
    return server.tiers.start_disk_load(k, server.tree.match_prefix(k))


def finish(server: Server, load) -> None:
    deadline = time.monotonic() + 10
    while not server.tiers.advance_disk_load(load):
        server.tiers.wait_disk_loads([load], 0.1)
        assert time.monotonic() < deadline, "the load did not end"


def test_a_prefix_on_disk_is_read_on_the_tiers_thread_into_the_host_tier(tmp_path, monkeypatch):
    server = restarted(tmp_path, chunk_pages=3)
    threads = record_reads(server.tiers.disk, monkeypatch)
    finish(server, start(server, KEY))
    assert threads == [READER] * 8 and len(server.tiers.host) == 8
    assert server.run(KEY) == 16 and len(threads) == 8  # admission: memory copies only
    assert server.tiers.info()["disk"]["hit_tokens"] == 16
    loads = server.tiers.disk_loads
    assert loads._num_buffers <= NUM_BUFFERS and all(len(b) == 3 for b in loads._free)
    server.check()
    server.tiers.close()


def test_no_load_starts_without_pages_on_disk(tmp_path):
    server = restarted(tmp_path)
    assert start(server, [50 + i for i in range(9)]) is None  # never computed
    finish(server, start(server, KEY))
    assert start(server, KEY) is None  # all in the host tier now
    server.tiers.close()


def test_a_load_ends_at_the_first_page_missing_on_disk(tmp_path):
    server = restarted(tmp_path)
    hashes = chain_hashes(ROOT_HASH, np.asarray(KEY[:16], np.int32), 2)
    (server.tiers.disk.dir / (hashes[4].tobytes().hex() + ".kv")).unlink()
    finish(server, start(server, KEY))
    assert len(server.tiers.host) == 4  # pages 5 to 7 are useless without page 4
    assert server.run(KEY) == 8
    server.check()
    server.tiers.close()


def test_a_cancelled_load_gives_its_buffer_back(tmp_path, monkeypatch):
    server = restarted(tmp_path, chunk_pages=2)
    gate = threading.Event()
    threads = record_reads(server.tiers.disk, monkeypatch, gate)
    loads = [start(server, KEY) for _ in range(NUM_BUFFERS + 1)]  # the last finds no buffer
    assert [load.read is not None for load in loads] == [True] * NUM_BUFFERS + [False]
    server.tiers.cancel_disk_load(loads[0])
    assert not server.tiers.advance_disk_load(loads[-1])  # its read is still running
    gate.set()
    for load in loads[1:]:
        finish(server, load)
    # the cancelled load stopped after the page being read, if any
    assert len(threads) - 8 * NUM_BUFFERS in (0, 1)
    assert server.tiers.disk_loads._num_buffers == NUM_BUFFERS
    assert server.run(KEY) == 16
    server.tiers.close()


# ---- through the scheduler ---------------------------------------------------------------------
class PagedPlusOneRunner(NumpyPool, PlusOneRunner):
    """PlusOneRunner with a KV pool of numpy rows: the step contract's page copies."""

    def __init__(self, num_pages: int) -> None:
        PlusOneRunner.__init__(self)
        NumpyPool.__init__(self, num_pages)


def tiered_scheduler(folder):
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=8, max_extend_seqs=8,
                          chunked_prefill_size=64, context_len=512)
    runner = PagedPlusOneRunner(64)
    disk = DiskTier(folder, FINGERPRINT, PAGE, ROW_ELEMS, np.int16, max_bytes=1 << 30)
    tiers = partial(TieredCache, runner, host=HostTier(64, ROW_ELEMS, np.int16), disk=disk)
    return Scheduler(cfg, runner, num_pages=64, decode=lambda ids, skip: "", eos_token_ids=(),
                     vocab_size=V, tiers=tiers)


def write_to_disk(folder, prompt: list[int]) -> None:
    """A scheduler over the disk tier in `folder` that ran `prompt` and closed (its pages on
    disk: write-through)."""
    first = tiered_scheduler(folder)
    first.add_request(request("a", prompt, 2))
    run_steps(first, {})
    first.tiers.close()


def test_a_request_waits_for_its_disk_pages_while_another_decodes(tmp_path, monkeypatch):
    prompt = list(range(100, 133))  # 8 whole pages of 4
    write_to_disk(tmp_path, prompt)

    sched = tiered_scheduler(tmp_path)
    gate = threading.Event()
    threads = record_reads(sched.tiers.disk, monkeypatch, gate)
    out: dict[str, dict] = {}
    sched.add_request(request("b", [7, 8, 9], 40))
    run_steps(sched, out, max_steps=2)
    sched.add_request(request("a", prompt, 4))
    sched.add_request(request("gone", prompt, 4))
    a, gone = sched.waiting[-2:]
    assert sched.kv.loading(a) and sched.kv.loading(gone)
    sched.abort("gone")
    decoded = len(out["b"]["ids"])
    run_steps(sched, out, max_steps=5)  # the reads wait at the gate; b decodes meanwhile
    assert len(out["b"]["ids"]) == decoded + 5 and "a" not in out
    assert sched.kv.loading(a) and not sched.kv.loading(gone)
    gate.set()
    run_steps(sched, out)
    assert not sched.has_work
    assert out["a"]["ids"] == expected(prompt, 4) and out["a"]["cached"] == 32
    assert out["b"]["ids"] == expected([7, 8, 9], 40)
    assert set(threads) == {READER}  # none on the scheduler thread
    assert sched.tiers.info()["disk"]["hit_tokens"] == 32
    sched.tiers.close()


def test_pages_read_from_disk_move_into_the_pool_a_steps_part_at_a_time(tmp_path):
    """While another request decodes, a step moves at most `step_pages` of the prefix read
    from disk into the pool, and the other decodes in every step of the load."""
    prompt = list(range(100, 133))  # 8 whole pages of 4
    write_to_disk(tmp_path, prompt)

    sched = tiered_scheduler(tmp_path)
    sched.tiers.step_pages = 3
    out = run_steps(sched, {}, max_steps=0)
    sched.add_request(request("b", [7, 8, 9], 40))
    run_steps(sched, out, max_steps=2)
    sched.add_request(request("a", prompt, 4))
    a = sched.waiting[-1]
    for _ in range(1000):  # the reads, on the reader thread, into the host tier
        if len(sched.tiers.host) == 8:
            break
        time.sleep(0.01)
        run_steps(sched, out, max_steps=1)
    cached = [sched.kv.tree.match_prefix(prompt).prefix_len]
    while sched.kv.loading(a):
        decoded = len(out["b"]["ids"])
        run_steps(sched, out, max_steps=1)
        cached.append(sched.kv.tree.match_prefix(prompt).prefix_len)
        assert len(out["b"]["ids"]) == decoded + 1 or not sched.kv.loading(a)
    assert cached == [0, 12, 24, 32]  # the last step: 2 pages, then `a` is admitted
    run_steps(sched, out)
    assert out["a"]["ids"] == expected(prompt, 4) and out["a"]["cached"] == 32
    assert out["b"]["ids"] == expected([7, 8, 9], 40)
    sched.tiers.close()


def test_a_session_request_loads_host_pages_at_arrival_and_disk_pages_off_thread(tmp_path,
                                                                                 monkeypatch):
    prompt = list(range(100, 133))
    write_to_disk(tmp_path, prompt)

    sched = tiered_scheduler(tmp_path)
    sched.add_request(request("half", prompt[:17], 1))  # its 4 pages: pool and host tier
    run_steps(sched, {})
    sched.kv.tree.evict(1000)  # now in the host tier only
    threads = record_reads(sched.tiers.disk, monkeypatch)
    msg = request("turn", prompt, 4)
    msg.session_id = "agent-1"
    sched.add_request(msg)
    turn = sched.waiting[-1]
    assert sched.kv.tree.match_prefix(prompt).prefix_len == 16  # loaded from the host tier
    assert sched.kv.loading(turn)  # the other 4 pages: from disk
    out = run_steps(sched, {})
    assert out["turn"]["ids"] == expected(prompt, 4) and out["turn"]["cached"] == 32
    assert set(threads) == {READER}
    sched.tiers.close()
