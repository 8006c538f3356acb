"""Prefetch through a real server (scheduler/prefetch.py): a small pool over a host tier, a
paused program whose KV other traffic pushed out to the host tier is moved back before its next
request, which then finds it in the pool; a prefetch whose program does not come back is counted
wasted; of two paused programs the one expected back first is prefetched, and a prefetch its
return would evict is skipped and counted; `/kv_hints` (retain / prefetch / release) works and
refuses bad hints with a 400; the counters appear per program in `/server_info` and
`/metrics` under public ids only; with `--disable-kv-prefetch` the request loads its prefix
itself; pages the host tier dropped are prefetched from the disk tier; the tier crossover
(mem_cache/load_cost.py) is fitted and reported, and a prefix part below it is computed,
neither loaded nor prefetched."""

from __future__ import annotations

import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

POOL_TOKENS = 1024
# no session-hint pins: a paused program's KV is evicted (demoted) like any other
TIERED = ("--skip-warmup", "--dtype", "float32", "--max-total-tokens", str(POOL_TOKENS),
          "--max-running-requests", "4", "--session-retention-s", "0", "--tool-pause-grace-s",
          "0", "--enable-hierarchical-cache")
FLAGS = (*TIERED, "--hicache-ratio", "4")
# prefetch tests: every load runs (for the tiny model computing can beat loading, and the
# fitted crossover would then skip loads these tests expect)
ALWAYS_LOAD = (*FLAGS, "--hicache-min-load-tokens", "0")
PAUSE_S = 2.5  # the programs' tool pause: a prefetch comes due after half of it, and a program
# that has not come back after twice its longest pause is found idle (its prefetch wasted)
PREFIX_TOKENS = 600


@pytest.fixture(scope="module")
def server(tiny_model_4k):
    from server_harness import launch_server

    handle = launch_server(*ALWAYS_LOAD, model_path=tiny_model_4k)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reactive_server(tiny_model_4k):
    """Prefetch off; the tier crossover fitted (no test before the fit's loads expects one)."""
    from server_harness import launch_server

    handle = launch_server(*FLAGS, "--disable-kv-prefetch", model_path=tiny_model_4k)
    yield handle
    handle.stop()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 390) for _ in range(n)]


def _generate(server, ids: list[int], key: str | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    if key is not None:
        body["session_id"] = key
    return server.post_ok("/generate", body)


def _turn(server, key: str, ids: list[int]) -> list[int]:
    """One turn of program `key`: the ids its next turn resends (prompt + output)."""
    out = _generate(server, ids, key)
    return ids + out["output_ids"]


def _new_program(server, key: str, ids: list[int]) -> tuple[str, list[int]]:
    """Two turns of `key` with a PAUSE_S pause between them (its expected pause), then pushed
    out of the pool by other traffic; returns its public id and its context."""
    before = set(server.info()["programs"]["recent"])
    context = _turn(server, key, ids)
    (public_id,) = set(server.info()["programs"]["recent"]) - before
    time.sleep(PAUSE_S)
    context = _turn(server, key, context + _ids(40, hash(key) & 0xFFFF))
    for i in range(2):  # other traffic: each prompt nearly fills the pool
        _generate(server, _ids(POOL_TOKENS - 160, 1000 + i + (hash(key) & 0xFF)))
    return public_id, context


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_paused_programs_kv_comes_back_before_its_next_request(server):
    key = f"agent-{uuid.uuid4().hex}"
    public_id, context = _new_program(server, key, _ids(PREFIX_TOKENS, 1))
    info = server.info()
    assert info["memory"]["evicted_tokens"] >= PREFIX_TOKENS // 2  # it left the pool
    _wait(lambda: server.info()["programs"]["recent"][public_id]["kv"]["prefetched_tokens"]
          >= PREFIX_TOKENS - 16)
    before = server.info()["programs"]["recent"][public_id]["kv"]
    out = _generate(server, context + _ids(30, 7), key)
    after = server.wait_idle()["programs"]["recent"][public_id]["kv"]
    resumed = len(context) // 16 * 16
    assert out["meta_info"]["cached_tokens"] >= resumed - 16
    assert after["reused_tokens"] - before["reused_tokens"] >= resumed - 16  # from the pool
    assert after["loaded_tokens"] == before["loaded_tokens"]  # nothing left to load
    assert after["num_prefetch_hits"] == before["num_prefetch_hits"] + 1
    assert after["num_prefetch_late"] == 0
    totals = server.info()["programs"]["kv"]
    assert totals["prefetched_tokens"] >= after["prefetched_tokens"]
    assert server.info()["integrity"] == "ok"


def test_a_prefetch_whose_program_does_not_come_back_is_wasted(server):
    key = f"agent-{uuid.uuid4().hex}"
    public_id, _ = _new_program(server, key, _ids(PREFIX_TOKENS, 2))
    _wait(lambda: server.info()["programs"]["recent"][public_id]["kv"]["num_prefetches"] >= 1)
    # its pause window (twice its longest pause) ends without its next request
    _wait(lambda: server.info()["programs"]["recent"][public_id]["kv"]
          ["num_prefetch_wasted"] == 1)
    totals = server.info()["programs"]["kv"]
    assert totals["num_prefetch_wasted"] >= 1


def _hints(server, key, *actions, version="0.1") -> requests.Response:
    body = {"session_id": key, "kv_hints": {
        "protocol_version": version, "message_id": uuid.uuid4().hex,
        "actions": [{"action_id": f"a{i}", "action_version": "0.1", **a}
                    for i, a in enumerate(actions)]}}
    return requests.post(server.base_url + "/kv_hints", json=body, timeout=60)


def test_hints_retain_prefetch_release_and_bad_hints_are_a_400(server):
    key = f"agent-{uuid.uuid4().hex}"
    before = set(server.info()["programs"]["recent"])
    context = _turn(server, key, _ids(PREFIX_TOKENS, 3))
    (public_id,) = set(server.info()["programs"]["recent"]) - before
    r = _hints(server, key, {"action_type": "retain", "payload": {"ttl_seconds": 1e6}})
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [{"action_id": "a0", "status": "clipped"}]
    r = _hints(server, key, {"action_type": "release"})
    assert r.json()["results"][0]["status"] == "accepted"
    for i in range(2):
        _generate(server, _ids(POOL_TOKENS - 160, 2000 + i))
    r = _hints(server, key, {"action_type": "prefetch", "payload": {"ttl_seconds": 30}})
    assert r.status_code == 200 and r.json()["results"][0]["status"] == "accepted", r.text
    _wait(lambda: server.info()["programs"]["recent"][public_id]["kv"]["prefetched_tokens"]
          >= PREFIX_TOKENS - 16)
    out = _generate(server, context + _ids(20, 9), key)
    assert out["meta_info"]["cached_tokens"] >= len(context) // 16 * 16 - 16
    assert server.wait_idle()["programs"]["recent"][public_id]["kv"]["num_prefetch_hits"] == 1
    unknown = _hints(server, f"nobody-{uuid.uuid4().hex}", {"action_type": "prefetch"})
    assert unknown.status_code == 200 and unknown.json()["results"][0]["status"] == "missing"
    for bad, named in (
            (_hints(server, key, {"action_type": "pin"}), "action_type"),
            (_hints(server, key, {"action_type": "retain"}, version="2"), "protocol_version"),
            (_hints(server, key, {"action_type": "retain", "payload": {"ttl_seconds": -1}}),
             "ttl_seconds"),
            (_hints(server, "", {"action_type": "release"}), "session_id"),
            (requests.post(server.base_url + "/kv_hints", json={"session_id": key},
                           timeout=60), "kv_hints")):
        assert bad.status_code == 400, bad.text
        assert named in bad.json()["error"]["message"], bad.text


def test_no_client_key_appears_in_server_info_or_metrics(server):
    key = f"secret-{uuid.uuid4().hex}"
    _turn(server, key, _ids(64, 4))
    info = requests.get(server.base_url + "/server_info", timeout=60).text
    metrics = requests.get(server.base_url + "/metrics", timeout=60).text
    assert key not in info and key not in metrics
    public_ids = server.info()["programs"]["recent"]
    assert any(f'program="{pid}"' in metrics for pid in public_ids)
    assert 'sglang:program_prefetched_tokens{model_name=' in metrics
    assert 'program="all"' in metrics


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def test_the_program_expected_back_first_is_prefetched_and_one_it_would_evict_is_skipped(
        server):
    """A pauses first but is expected back last (its pauses are long); B pauses after it but is
    expected back first, and its working set (two requests at once) is the whole pool. B's KV
    is prefetched; A's prefetch, which B's return would evict, is skipped and counted."""
    a_key, b_key = f"agent-a-{uuid.uuid4().hex}", f"agent-b-{uuid.uuid4().hex}"
    a_pause_s, b_pause_s = 7.0, 4.0  # A due after 3.5 s, back after 7; B back after 4
    seen = set(server.info()["programs"]["recent"])
    a_context = _turn(server, a_key, _ids(PREFIX_TOKENS, 20))
    a_ended = time.monotonic()
    (a_id,) = set(server.info()["programs"]["recent"]) - seen
    _sleep_until(a_ended + a_pause_s - b_pause_s)
    b_prompts = [_ids(PREFIX_TOKENS - 60, 21 + i) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # B's working set: two 542-token contexts > the pool
        outs = list(pool.map(lambda ids: _generate(server, ids, b_key), b_prompts))
    b_ended = time.monotonic()
    (b_id,) = set(server.info()["programs"]["recent"]) - seen - {a_id}
    b_context = b_prompts[0] + outs[0]["output_ids"]
    _sleep_until(a_ended + a_pause_s)
    a_context = _turn(server, a_key, a_context + _ids(40, 22))  # A pauses first
    _sleep_until(b_ended + b_pause_s)
    b_context = _turn(server, b_key, b_context + _ids(40, 23))  # then B
    for i in range(2):  # other traffic pushes both out to the host tier
        _generate(server, _ids(POOL_TOKENS - 160, 4000 + i))

    def kv(public_id: str) -> dict:
        return server.info()["programs"]["recent"][public_id]["kv"]

    # (their first pauses, expected as long as other programs' so far, may have prefetched)
    a_before, b_before = kv(a_id), kv(b_id)
    _wait(lambda: kv(b_id)["prefetched_tokens"] - b_before["prefetched_tokens"]
          >= PREFIX_TOKENS - 60 - 16)
    _wait(lambda: kv(a_id)["num_prefetch_skipped"] >= 1)  # A came due while B pauses
    a_kv, b_kv = kv(a_id), kv(b_id)
    assert a_kv["num_prefetches"] == a_before["num_prefetches"]
    assert a_kv["prefetched_tokens"] == a_before["prefetched_tokens"]
    assert a_kv["num_prefetch_skipped"] == 1  # once per pause
    assert b_kv["num_prefetches"] == b_before["num_prefetches"] + 1
    assert b_kv["num_prefetch_skipped"] == 0
    assert server.info()["programs"]["kv"]["num_prefetch_skipped"] >= 1
    metrics = requests.get(server.base_url + "/metrics", timeout=60).text
    assert re.search(rf'sglang:program_prefetch_skipped{{[^}}]*program="{a_id}"[^}}]*}} 1\.0',
                     metrics), metrics
    out = _generate(server, b_context + _ids(30, 24), b_key)
    after = server.wait_idle()["programs"]["recent"][b_id]["kv"]
    assert out["meta_info"]["cached_tokens"] >= len(b_context) // 16 * 16 - 16
    assert after["num_prefetch_hits"] == b_kv["num_prefetch_hits"] + 1
    assert after["loaded_tokens"] == b_kv["loaded_tokens"]
    assert server.info()["integrity"] == "ok"


def test_with_prefetch_off_the_returning_request_loads_its_prefix(reactive_server):
    server = reactive_server
    # its first load from the host tier: the crossover is not fitted yet, so it loads
    key = f"agent-{uuid.uuid4().hex}"
    public_id, context = _new_program(server, key, _ids(PREFIX_TOKENS, 5))
    time.sleep(PAUSE_S)  # past the point where a prefetch would have come due
    out = _generate(server, context + _ids(30, 8), key)
    kv = server.wait_idle()["programs"]["recent"][public_id]["kv"]
    assert out["meta_info"]["cached_tokens"] >= len(context) // 16 * 16 - 16
    assert kv["num_prefetches"] == 0 and kv["prefetched_tokens"] == 0
    assert kv["loaded_tokens"] >= PREFIX_TOKENS - 16  # loaded when the request came


def test_a_prefix_the_host_tier_dropped_is_prefetched_from_disk(tiny_model_4k, tmp_path):
    from server_harness import launch_server

    # a host tier as small as the pool: the other traffic pushes the program's pages on to disk
    flags = (*TIERED, "--hicache-min-load-tokens", "0", "--hicache-ratio", "1",
             "--hicache-storage-backend", "file",
             "--hicache-storage-dir", str(tmp_path))
    with launch_server(*flags, model_path=tiny_model_4k) as server:
        key = f"agent-{uuid.uuid4().hex}"
        public_id, context = _new_program(server, key, _ids(PREFIX_TOKENS, 6))
        _wait(lambda: server.info()["programs"]["recent"][public_id]["kv"]["prefetched_tokens"]
              >= PREFIX_TOKENS - 16)
        out = _generate(server, context + _ids(30, 9), key)
        info = server.wait_idle()
        kv = info["programs"]["recent"][public_id]["kv"]
        assert out["meta_info"]["cached_tokens"] >= len(context) // 16 * 16 - 16
        assert kv["num_prefetch_hits"] == 1 and kv["loaded_tokens"] == 0
        assert info["tiers"]["disk"]["hit_tokens"] > 0  # (some) pages came from disk
        assert info["integrity"] == "ok"


def _load_from_host(server, seed: int, num_tokens: int) -> dict:
    """A prompt of `num_tokens`, pushed out of the pool by other traffic, sent again with a few
    more tokens: its second request's answer."""
    ids = _ids(num_tokens, seed)
    _generate(server, ids)
    for i in range(2):
        _generate(server, _ids(POOL_TOKENS - 160, 3000 + 2 * seed + i))
    return _generate(server, ids + _ids(20, seed + 1))


def test_the_tier_crossover_is_fitted_and_reported(reactive_server):
    server = reactive_server
    for seed in range(3):  # loads of three sizes, and their prefills
        _load_from_host(server, 40 + seed, 200 + 200 * seed)
    cost = server.wait_idle()["tiers"]["load_cost"]
    assert cost["source"] == "fit"
    assert cost["compute"]["samples"] >= 3 and cost["compute"]["s_per_token"] > 0
    assert cost["host_load"]["samples"] >= 3 and cost["host_load"]["s_per_token"] > 0
    crossover = cost["host_crossover_tokens"]
    assert (crossover is None) == cost["host_never_load"]
    if crossover is not None:  # the least length whose load beats its compute
        load, compute = cost["host_load"], cost["compute"]["s_per_token"]

        def load_wins(n: int) -> bool:
            return load["fixed_s"] + n * load["s_per_token"] < n * compute

        assert load_wins(crossover) and (crossover == 1 or not load_wins(crossover - 1))
        assert server.info()["tiers"]["host"]["crossover_tokens"] == crossover


def test_below_the_crossover_a_prefix_is_computed_not_loaded_or_prefetched(tiny_model_4k):
    from server_harness import launch_server

    with launch_server(*FLAGS, "--hicache-min-load-tokens", "700",
                       model_path=tiny_model_4k) as server:
        tiers = server.info()["tiers"]
        assert tiers["load_cost"]["source"] == "flag"
        assert tiers["host"]["crossover_tokens"] == 700
        key = f"agent-{uuid.uuid4().hex}"
        public_id, context = _new_program(server, key, _ids(PREFIX_TOKENS, 10))
        time.sleep(PAUSE_S)  # past the point where a prefetch would have come due
        host_before = server.info()["tiers"]["host"]
        out = _generate(server, context + _ids(30, 11), key)
        info = server.wait_idle()
        kv = info["programs"]["recent"][public_id]["kv"]
        assert kv["num_prefetches"] == 0 and kv["loaded_tokens"] == 0
        assert info["tiers"]["host"]["hit_tokens"] == host_before["hit_tokens"]
        skipped = info["tiers"]["host"]["skipped_tokens"] - host_before["skipped_tokens"]
        assert skipped >= len(context) // 16 * 16 - out["meta_info"]["cached_tokens"] - 16
        assert skipped > 0
        # a longer prefix part in the host tier than the crossover loads
        out = _load_from_host(server, 50, 800)
        assert out["meta_info"]["cached_tokens"] >= 800 - 16
        assert server.wait_idle()["tiers"]["host"]["hit_tokens"] > host_before["hit_tokens"]
        assert info["integrity"] == "ok"
