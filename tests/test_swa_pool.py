"""The sliding-window pool of hybrid models (mem_cache/swa_pool.py): its allocator, how the KV
manager drops and keeps window pages, and tiny Gemma 2 / Gemma 3 engines that give the same
greedy tokens with the pool as without it while it drops windows and computes cut prefixes
again."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gemma_checkpoints import WINDOW, make_tiny_gemma

from sgl_tpu.config import SchedulerConfig, ServerArgs
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.mem_cache import tiers as tiers_module
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, chain_hashes
from sgl_tpu.mem_cache.swa_pool import SwaPageAllocator, pool_split
from sgl_tpu.mem_cache.tiers import global_only_hash
from sgl_tpu.models.config import GemmaConfig
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.req import Req

PS = 4


def test_pool_split_keeps_the_memory_and_triples_gemma3_270m_tokens():
    # Gemma 3 270M: 18 layers, 15 local with a 512-token window; the default flags
    main, window = pool_split(65536, 18, 15, 0.125, 512 + 2048 + 32, 16)
    assert 3 * main + 15 * window <= 18 * 65536  # no more memory than without the pool
    assert main >= 3.6 * 65536 and main % 16 == 0 and window % 16 == 0
    assert window == pytest.approx(0.125 * main, abs=16)
    # the floor: a window plus a prefill chunk, whatever the ratio
    assert pool_split(65536, 18, 15, 0.001, 2592, 16)[1] == 2592
    # a memory that a window pool would leave no more tokens: one pool
    assert pool_split(2048, 18, 15, 0.125, 2592, 16) is None


def test_allocation_and_free_keep_window_pages_in_step():
    asked = []
    alloc = SwaPageAllocator(16, PS, window=6, num_window_pages=5, reclaim=asked.append)
    pages = alloc.alloc(3)
    windows = alloc.window_of[pages]
    assert (windows > 0).all() and len(set(windows.tolist())) == 3
    assert alloc.windows.num_free_pages == 1 and not asked
    # one window page left: the allocator asks for the 2 it lacks, then takes nothing
    assert alloc.alloc(3) is None and asked == [2]
    assert alloc.num_free_pages == 12 and alloc.windows.num_free_pages == 1
    alloc.drop_windows(pages[:2])
    assert alloc.num_dropped == 2 and alloc.window_of[pages[:2]].tolist() == [0, 0]
    with pytest.raises(ValueError, match="hold window pages"):
        alloc.drop_windows(pages[:1])  # already dropped
    more = alloc.alloc(3)
    assert more is not None and (alloc.window_of[more] > 0).all()
    alloc.check()
    with pytest.raises(ValueError, match="double free"):
        alloc.free([more[0], more[0]])
    alloc.check()  # (the failed free changed nothing)
    alloc.free(np.concatenate([pages, more]))
    assert alloc.num_free_pages == 15 and alloc.windows.num_free_pages == 4
    assert not alloc.window_of.any()
    alloc.check()


def test_check_catches_a_window_page_mapped_twice():
    alloc = SwaPageAllocator(8, PS, window=6, num_window_pages=8)
    pages = alloc.alloc(2)
    alloc.window_of[pages[1]] = alloc.window_of[pages[0]]
    with pytest.raises(RuntimeError, match="window pages"):
        alloc.check()


def test_adopt_moves_a_window_page_to_the_kept_copy_only_where_it_lacks_one():
    alloc = SwaPageAllocator(16, PS, window=6, num_window_pages=16)
    keep, dup = alloc.alloc(3), alloc.alloc(3)
    alloc.drop_windows(keep[:2])
    before = alloc.window_of[dup].copy()
    alloc.adopt(keep, dup)
    assert alloc.window_of[keep[:2]].tolist() == before[:2].tolist()
    assert alloc.window_of[dup].tolist() == [0, 0, before[2]]
    alloc.free(dup)
    alloc.check()


@pytest.mark.parametrize("window", [1, 5, 6, 8, 13])
def test_usable_prefix_is_the_longest_whose_window_survived(window):
    alloc = SwaPageAllocator(64, PS, window=window, num_window_pages=64)
    pages = alloc.alloc(10)
    rng = np.random.default_rng(window)
    for _ in range(40):
        held = rng.random(10) < 0.7
        alloc.window_of[pages] = np.where(held, np.arange(1, 11), 0)
        length = int(rng.integers(0, 11)) * PS

        # brute force: a prefix of e pages holds every page from its first window page on
        best = max(e for e in range(length // PS + 1)
                   if all(held[alloc.first_window_page(e * PS): e]))
        assert alloc.usable_prefix(pages, length) == best * PS


def _manager(num_pages: int, window_pages: int) -> KVManager:
    config = SchedulerConfig(page_size=PS, max_running_requests=8, max_extend_seqs=8,
                             chunked_prefill_size=64, context_len=512)
    return KVManager.for_config(config, num_pages, swa=(WINDOW, window_pages))


def _run(kv: KVManager, req: Req, tokens: int) -> None:
    """Admit `req` and pretend a step computed `tokens` of its prompt."""
    kv.admit_prefix(req)
    assert kv.alloc_pages(req, kv.pages_needed(req, req.kv_len + tokens))
    req.kv_len += tokens


def _req(ids: list[int]) -> Req:
    return Req(rid=str(ids[:3]), origin_input_ids=ids, sampling=SamplingParams(), seed=0)


def test_windows_of_running_requests_survive_and_their_old_pages_go_first():
    kv = _manager(64, 12)
    cached = _req(list(range(100, 132)))  # 8 pages, then only in the tree
    _run(kv, cached, 32)
    kv.release_req(cached)
    running = _req(list(range(200, 240)))
    kv.admit_prefix(running)
    for _ in range(5):  # 2 pages a step: 4 window pages were free, then others' are taken
        assert kv.alloc_pages(running, 2)
        running.kv_len += 2 * PS
        kv.check([running])
        window = running.pages[kv.swa.first_window_page(running.kv_len):]
        assert kv.swa.window_of[window].all()
    assert kv.swa.num_dropped >= 6
    # its own pages below its window went first, then the tree's oldest; a node's last
    # window went last
    assert not kv.swa.window_of[running.pages[:3]].any()
    tail = kv.tree.match_prefix(cached.origin_input_ids).slots[-2 * PS :: PS] // PS
    assert kv.swa.window_of[tail].all()
    # a second request can still get pages: the window pages outside windows go
    other = _req(list(range(300, 316)))
    _run(kv, other, 16)
    kv.check([running, other])
    assert kv.available_pages() <= kv.swa.windows.num_usable_pages
    for req in (running, other):
        kv.release_req(req)
    kv.check([])


def test_a_prefix_whose_window_was_dropped_is_cut_there():
    kv = _manager(64, 16)
    ids = list(range(100, 140))  # 10 pages
    first = _req(ids)
    _run(kv, first, 40)
    kv.release_req(first)
    pages = kv.tree.match_prefix(ids).slots[::PS] // PS
    kv.swa.drop_windows(pages[7:8])  # inside the window of a 10-page prefix
    again = _req(ids + [1, 2, 3])
    kv.admit_prefix(again)
    assert again.kv_len == kv.swa.usable_prefix(pages, 40) == 28
    assert kv.num_window_cut_tokens == 12
    assert kv.memory_info()["swa"]["num_window_cut_tokens"] == 12
    # the request computes pages 7-9 again; the tree's copy of page 7 takes its window page
    assert kv.alloc_pages(again, kv.pages_needed(again, 43))
    again.kv_len = 43
    kv.cache_req(again)
    assert kv.swa.window_of[pages[7]] > 0
    kv.check([again])
    kv.release_req(again)
    kv.check([])


def test_runner_config_splits_the_memory_only_where_the_pool_can_run():
    gemma = GemmaConfig(sliding_window=512, sliding_layers=(True,) * 5 + (False,),
                        rope_local_theta=1e4, query_pre_attn_scalar=256)
    args = ServerArgs(backend="torch", device="cpu", max_total_tokens=65536)
    cfg = runner_config(args, 32768, gemma=gemma)
    main, window = (cfg.num_pages - 1) * 16, (cfg.swa_num_pages - 1) * 16
    assert cfg.swa_window == 512 and main + 5 * window <= 6 * 65536 and main > 2.5 * 65536
    assert runner_config(args.replace(enable_hierarchical_cache=True), 32768,
                         gemma=gemma).swa_num_pages == cfg.swa_num_pages
    for off in (dict(disable_hybrid_swa_memory=True), dict(backend="jax")):
        cfg = runner_config(args.replace(**off), 32768, gemma=gemma)
        assert (cfg.swa_num_pages, cfg.num_pages) == (0, 4097)
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        ServerArgs(swa_full_tokens_ratio=0)


# ---- engines: the same greedy tokens with the pool as without it ---------------------------

@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny_gemma(request, tmp_path_factory):
    return make_tiny_gemma(tmp_path_factory.mktemp(request.param), request.param)


def _workload(engine) -> list[list[int]]:
    """Shared prefixes, a second turn, a prompt cut inside a cached one, concurrent requests."""
    rng = np.random.default_rng(0)
    base = rng.integers(5, 200, 300).tolist()
    prompts = [base[:200] + rng.integers(5, 200, 40).tolist() for _ in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    outs.append(engine.generate(input_ids=prompts[0] + outs[0] + [7, 8, 9],
                                sampling_params=sp)["output_ids"])
    outs += [r["output_ids"] for r in engine.generate(input_ids=prompts + [base[:97]],
                                                      sampling_params=sp)]
    outs.append(engine.generate(input_ids=base[:150], sampling_params=sp)["output_ids"])
    return outs


def test_engine_gives_the_same_tokens_with_the_window_pool(tiny_gemma):
    from sgl_tpu.engine import Engine

    common = dict(backend="torch", dtype="float32", page_size=PS, max_total_tokens=2048,
                  chunked_prefill_size=64, max_running_requests=4, torch_compile="off")
    results, infos = {}, {}
    for pool in (False, True):
        with Engine(tiny_gemma, disable_hybrid_swa_memory=not pool, swa_full_tokens_ratio=0.05,
                    **common) as engine:
            results[pool] = _workload(engine)
            infos[pool] = engine.get_server_info()
    assert results[True] == results[False]
    plain, hybrid = infos[False]["memory"], infos[True]["memory"]
    assert "swa" not in plain and hybrid["kv_bytes"] == plain["kv_bytes"]
    # 2 of the 3 layers local: the same bytes hold 2.7x the tokens at this ratio
    assert hybrid["max_total_tokens"] >= 2.5 * plain["max_total_tokens"]
    assert hybrid["kv_tokens_per_gb"] >= 2.5 * plain["kv_tokens_per_gb"] > 0
    swa = hybrid["swa"]
    assert swa["window"] == WINDOW
    # the small window pool dropped windows and cut a cached prefix, and lost nothing
    assert swa["num_windows_dropped"] > 0 and swa["num_window_cut_tokens"] > 0
    assert infos[True]["integrity"] == "ok"


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_under_the_window_pool(tiny_gemma, policy, chunked, monkeypatch):
    """Prompts that overflow a small pool go to the host tier and come back: the same tokens as
    one pool without tiers. Written through, their rows are whole (copied while the windows
    were there) and the repeated prompts are served from them; written back at eviction, the
    tiny window pool had dropped their windows: global-only rows, loaded and then cut.
    `chunked`: loads a page at a time, which keep only the window pages of a load in one
    piece (the small window pool would not hold one per page)."""
    from sgl_tpu.engine import Engine

    if chunked:
        monkeypatch.setattr(tiers_module, "CHUNK_BYTES", 1)  # one page per chunk

    common = dict(backend="torch", dtype="float32", page_size=PS, chunked_prefill_size=64,
                  max_running_requests=4, torch_compile="off", max_total_tokens=256)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, 150).tolist() for _ in range(5)]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    results = {}
    for tiers in (False, True):
        # every load runs (hicache_min_load_tokens=0): for this tiny model the fitted tier
        # crossover may find computing a prompt faster than loading it page by page
        kw = dict(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy=policy,
                  swa_full_tokens_ratio=0.05, hicache_min_load_tokens=0
                  ) if tiers else dict(disable_hybrid_swa_memory=True)
        with Engine(tiny_gemma, **common, **kw) as engine:
            outs = [engine.generate(input_ids=p, sampling_params=sp) for p in prompts * 2]
            results[tiers] = [o["output_ids"] for o in outs]
            if not tiers:
                continue
            info = engine.get_server_info()
            assert info["integrity"] == "ok" and info["tiers"]["host"]["hit_tokens"] > 0
            host = engine.scheduler.tiers.host
            hashes = [h.tobytes() for p in prompts
                      for h in chain_hashes(ROOT_HASH, np.asarray(p, np.int32), PS)]
            global_only = sum(global_only_hash(h) in host for h in hashes)
            again = [o["meta_info"]["cached_tokens"] for o in outs[len(prompts):]]
            if policy == "write_through":
                assert global_only == 0 and min(again) >= 140
            else:
                assert global_only > 0 and info["memory"]["swa"]["num_window_cut_tokens"] > 0
    assert results[True] == results[False]


def test_int8_pool_under_the_window_pool_and_the_host_tier(tiny_gemma):
    """`--kv-cache-dtype int8` on a hybrid model: the window pool and the host tier move int8
    head rows with their scales like any pool's rows, so prompts that overflow the pool and
    come back from the host tier give the same greedy tokens as one int8 pool without either;
    the host tier's rows are int8's (d + 2 bytes per head row, not 2d)."""
    from sgl_tpu.engine import Engine
    from sgl_tpu.kv_dtypes import kv_dtype

    common = dict(backend="torch", dtype="float32", page_size=PS, chunked_prefill_size=64,
                  max_running_requests=4, torch_compile="off", max_total_tokens=256,
                  kv_cache_dtype="int8")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, 150).tolist() for _ in range(5)]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    results = {}
    for tiers in (False, True):
        kw = dict(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_min_load_tokens=0,
                  swa_full_tokens_ratio=0.05) if tiers else dict(disable_hybrid_swa_memory=True)
        with Engine(tiny_gemma, **common, **kw) as engine:
            results[tiers] = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"]
                              for p in prompts * 2]
            info = engine.get_server_info()
            assert info["memory"]["kv_cache_dtype"] == "int8"
            if tiers:
                assert info["integrity"] == "ok" and info["tiers"]["host"]["hit_tokens"] > 0
                cfg = engine.scheduler.runner.model_config
                int8 = kv_dtype("int8").token_bytes(cfg.num_layers, cfg.num_kv_heads,
                                                    cfg.head_dim)
                assert engine.scheduler.tiers.host.row_bytes == PS * int8
    assert results[True] == results[False]


def test_windows_never_outgrow_their_pool():
    kv = _manager(128, 20)
    reqs = [_req([i] * 7 + list(range(1000 + 100 * i, 1040 + 100 * i))) for i in range(3)]
    for step, req in itertools.product(range(4), reqs):
        if step == 0:
            kv.admit_prefix(req)
        assert kv.alloc_pages(req, kv.pages_needed(req, req.kv_len + 10))
        req.kv_len += 10
        kv.check(reqs)
    for req in reqs:
        kv.release_req(req)
    kv.check([])


@pytest.mark.slow
def test_reliability_phases_on_a_window_pool(tmp_path):
    """A real server whose window pool holds a few requests' windows: load, disconnects and
    aborts, more requests than the pool holds; no 5xx, nothing leaked, windows dropped."""
    import asyncio

    from reliability_invariants import check_invariants
    from reliability_phases import disconnect_phase, exhaustion_phase, load_phase
    from server_harness import launch_server

    server = launch_server("--skip-warmup", "--max-total-tokens", "1024", "--dtype", "float32",
                           "--max-running-requests", "16", "--chunked-prefill-size", "256",
                           "--swa-full-tokens-ratio", "0.05",
                           model_path=make_tiny_gemma(tmp_path / "gemma3", "gemma3"))
    try:
        url = server.base_url
        memory = check_invariants(url, {})["memory"]
        assert memory["swa"]["window"] == WINDOW
        load = asyncio.run(load_phase(url, {}, clients=16, requests_per_client=2))
        assert load.num_5xx == 0 and load.statuses[200] > 0, load.to_dict()
        gone = asyncio.run(disconnect_phase(url, {}, clients=4))
        assert gone.num_5xx == 0 and gone.aborts == 4, gone.to_dict()
        full = asyncio.run(exhaustion_phase(url, {}, capacity_tokens=memory["max_total_tokens"],
                                            clients=16))
        assert full.statuses == {200: 16, 400: 1}, full.to_dict()
        assert full.extra["wrong_token_counts"] == 0
        info = check_invariants(url, {})
        assert info["memory"]["swa"]["num_windows_dropped"] > 0
        assert info["stats"]["num_retractions"] > 0
    finally:
        server.stop()
