"""sgl-tpu as a worker of SGLang's router (`sglang-router`), and the `--dp-size` launcher.

Unit: the router flags, the CLI round trip a replica is started with, the machine split, the
`sampling_seed` alias. End to end (real router, real replicas of a tiny checkpoint): one worker
behind the router answers every API as the worker does directly; two replicas keep each agent
on one replica under `cache_aware` (and `round_robin` hits the cache less); agents of the
default model that share one system prompt spread over both replicas under the launcher's
router defaults and keep their own trajectory's hits (`cache_aware`, and `manual` keyed by
session); a replica killed under load costs only a few requests; SIGTERM ends the whole tree;
a failing replica fails the launch.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from server_harness import DEFAULT_MODEL_FLAGS, REPO_ROOT, free_port, launch_server

from sgl_tpu.bench.agent_loop.__main__ import main as agent_loop_main
from sgl_tpu.bench.agent_loop.__main__ import replica_split
from sgl_tpu.cli import parse_args, to_argv
from sgl_tpu.config import ServerArgs
from sgl_tpu.engine import Engine
from sgl_tpu.sampling_params import SamplingParams, expand_n
from sgl_tpu.server.replicas import plan_placements, replica_argv, router_argv


def start_router(*worker_urls: str) -> tuple[subprocess.Popen, str]:
    """The sglang-router on a free local port over `worker_urls`; returns once it has
    registered a worker (its /v1/models answers)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
         str(port), "--worker-urls", *worker_urls, "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url  # up, with the worker registered
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router did not register the worker within 60 s")


MODEL = "tiny-llama"
FLAGS = ("--skip-warmup", "--served-model-name", MODEL, "--max-total-tokens", "16384",
         "--max-running-requests", "16", "--chunked-prefill-size", "512", "--dtype", "float32")


# --- unit ------------------------------------------------------------------------------------

def test_router_flags_pass_through_and_replica_argv_round_trips():
    args = parse_args(["--dp-size", "2", "--router-policy", "round_robin",
                       "--router-cache-threshold", "0.3", "--router-disable-retries",
                       "--api-key", "k", "--page-size", "32", "--allow-origins", "http://a"])
    assert args.dp_size == 2 and args.router_policy == "round_robin"
    assert args.router_args == ("--cache-threshold", "0.3", "--disable-retries")
    assert parse_args(to_argv(args)) == args
    one = replica_argv(args, 31234)
    replica = parse_args(one[3:])
    assert (replica.dp_size, replica.router_args, replica.port, replica.host) == \
        (1, (), 31234, "127.0.0.1")
    assert (replica.api_key, replica.page_size, replica.allow_origins) == ("k", 32, ("http://a",))
    router = router_argv(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert router[router.index("--policy") + 1] == "round_robin"
    assert router[router.index("--api-key") + 1] == "k"
    assert router[-3:] == ["--cache-threshold", "0.3", "--disable-retries"]
    # its metrics on a port of its own: two launches on one host do not collide
    router = router_argv(args, ["http://127.0.0.1:1"], metrics_port=31240)
    assert router[router.index("--prometheus-port") + 1] == "31240"


def test_router_defaults_scale_with_the_replica_and_yield_to_the_user():
    def flags(*argv: str) -> list[str]:
        router = router_argv(parse_args(["--dp-size", "2", *argv]), ["http://127.0.0.1:1"])
        return router[router.index("--log-level") + 2:]

    assert flags() == ["--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2"]
    assert flags("--max-running-requests", "256")[:2] == ["--balance-abs-threshold", "8"]
    assert flags("--router-balance-abs-threshold", "5") == [
        "--balance-rel-threshold", "1.2", "--balance-abs-threshold", "5"]
    assert flags("--router-balance-rel-threshold=2") == [
        "--balance-abs-threshold", "2", "--balance-rel-threshold=2"]
    assert flags("--router-policy", "manual") == ["--assignment-mode", "min_group"]
    assert flags("--router-policy", "manual", "--router-assignment-mode", "min_load") == [
        "--assignment-mode", "min_load"]
    assert flags("--router-policy", "round_robin") == []


def test_bench_replica_split():
    assert replica_split([3, 5], [10, 6]) == {"replica_requests": [7, 1]}
    assert replica_split(None, [1, 2]) == {} and replica_split([1], [1, 2]) == {}


@pytest.mark.parametrize("argv", [["--router-cache-threshold", "0.3"], ["--bogus-flag"],
                                  ["--dp-size", "0"], ["--dp-size", "2", "--router-policy", "x"]])
def test_bad_replica_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_placements_split_the_machine():
    assert [p.cpus for p in plan_placements(2, "cpu", [0, 1])] == [(0,), (1,)]
    assert [p.cpus for p in plan_placements(2, "cpu", [0, 1, 2, 3, 4])] == [(0, 1), (2, 3)]
    assert [p.cpus for p in plan_placements(3, "cpu", [4, 5])] == [(4,), (5,), (4,)]
    assert plan_placements(2, "cpu", [0, 1, 2, 3])[1].env["OMP_NUM_THREADS"] == "2"
    tpu = plan_placements(4, "tpu", [0])
    assert [p.env["TPU_VISIBLE_CHIPS"] for p in tpu] == ["0", "1", "2", "3"]
    assert len({p.env["TPU_PROCESS_PORT"] for p in tpu}) == 4
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan_placements(2, "cuda", [0])] == ["0", "1"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan_placements(2, "cuda", [0], tp_size=2)
            ] == ["0,1", "2,3"]  # each replica's tensor-parallel ranks get a GPU each


def test_sampling_seed_is_the_seed():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(ValueError, match="sampling_seed"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})
    assert [d["seed"] for d in expand_n({"sampling_seed": 7, "n": 2}, 2)] == [7, 8]


# --- end to end ------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_worker_behind_the_router(tiny_model_4k):
    worker = launch_server(*FLAGS, model_path=tiny_model_4k)
    router, url = start_router(worker.base_url)
    try:
        # registered under the served name, not "unknown"
        models = requests.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        info = requests.get(worker.base_url + "/server_info", timeout=30).json()
        assert (info["served_model_name"], info["tp_size"], info["dp_size"]) == (MODEL, 1, 1)
        assert requests.get(worker.base_url + "/model_info", timeout=30).json()[
            "served_model_name"] == MODEL
        load = requests.get(worker.base_url + "/get_load", timeout=30).json()
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0

        body = {"text": "Hello world! How are you", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}
        direct = requests.post(worker.base_url + "/generate", json=body, timeout=60).json()
        routed = requests.post(url + "/generate", json=body, timeout=60)
        assert routed.status_code == 200 and routed.json()["text"] == direct["text"]
        streamed = requests.post(url + "/generate", json={**body, "stream": True}, timeout=60,
                                 stream=True)
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in _sse_lines(streamed)
                  if line.startswith("data: {")]
        assert events[-1]["text"] == direct["text"]

        comp = {"model": MODEL, "prompt": "Hello world!", "max_tokens": 8, "temperature": 0}
        assert requests.post(url + "/v1/completions", json=comp, timeout=60).json()[
            "choices"][0]["text"] == requests.post(worker.base_url + "/v1/completions",
                                                   json=comp, timeout=60).json()[
            "choices"][0]["text"]
        chat = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello world!"}]}
        want = requests.post(worker.base_url + "/v1/chat/completions", json=chat,
                             timeout=60).json()["choices"][0]["message"]["content"]
        resp = requests.post(url + "/v1/chat/completions", json={**chat, "stream": True},
                             timeout=60, stream=True)
        assert resp.status_code == 200
        got = "".join(
            (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for line in _sse_lines(resp) if line.startswith("data: {"))
        assert got == want

        # sampling_seed (what the router keeps) reproduces seed sent directly
        sampled = {"text": "The quick brown fox", "sampling_params": {
            "max_new_tokens": 12, "temperature": 1.0}}
        seeded = requests.post(worker.base_url + "/generate", json={**sampled, "sampling_params": {
            **sampled["sampling_params"], "seed": 1234}}, timeout=60).json()["text"]
        via_router = requests.post(url + "/generate", json={**sampled, "sampling_params": {
            **sampled["sampling_params"], "sampling_seed": 1234}}, timeout=60).json()["text"]
        assert via_router == seeded

        # the routing key or session_params.id names the agent's session (both survive the
        # router): its KV is retained after the request; without either it is not
        long_body = {**body, "text": _system_prompt(0)}  # many pages
        long_chat = {**chat, "messages": [{"role": "user", "content": _system_prompt(1)}]}
        header = {"X-SMG-Routing-Key": "agent-7"}
        for route, payload, headers in [
                ("/generate", long_body, header),
                ("/generate", {**long_body, "session_params": {"id": "agent-8"}}, {}),
                ("/v1/chat/completions", long_chat, header)]:
            assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
            plain = {k: v for k, v in payload.items() if k != "session_params"}
            requests.post(url + route, json=plain, timeout=60).raise_for_status()
            assert _retained(worker.base_url) == 0
            requests.post(url + route, json=payload, timeout=60,
                          headers=headers).raise_for_status()
            assert _retained(worker.base_url) > 0, (route, payload.keys(), headers)
    finally:
        router.kill()
        router.wait()
        worker.stop()


def _sse_lines(resp: requests.Response) -> list[str]:
    return [line.decode() for line in resp.iter_lines()]


def _retained(base_url: str) -> int:
    info = requests.get(base_url + "/server_info", timeout=30).json()
    return info["memory"]["tree_retained_tokens"]


NUM_AGENTS, NUM_TURNS = 8, 4


def _system_prompt(agent: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    # distinct from the first character on (the router matches text prefixes)
    return f"Agent {agent} {words[agent]}: " + " ".join(
        f"{words[(agent * 3 + i) % 8]}{(agent * 7919 + i * 31) % 1000}" for i in range(120))


def _run_agents(url: str) -> list[list[dict]]:
    """8 agents x 4 turns; each turn resends the trajectory. Returns each agent's meta_infos."""
    def agent(a: int) -> list[dict]:
        text, metas = _system_prompt(a), []
        for turn in range(NUM_TURNS):
            resp = requests.post(url + "/generate", timeout=300, json={
                "text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
            resp.raise_for_status()
            out = resp.json()
            metas.append(out["meta_info"])
            text += out["text"] + f"\nObservation {turn}: result {a * 10 + turn}.\n"
        return metas

    with concurrent.futures.ThreadPoolExecutor(NUM_AGENTS) as pool:
        return list(pool.map(agent, range(NUM_AGENTS)))


def _worker_urls(router_url: str, headers: dict[str, str] | None = None) -> list[str]:
    workers = requests.get(router_url + "/workers", headers=headers, timeout=30).json()
    return sorted(w["url"] for w in workers["workers"])


def _finished(worker_url: str) -> int:
    return requests.get(worker_url + "/server_info", timeout=30).json()[
        "stats"]["num_requests_finished"]


def _score(metas: list[list[dict]]) -> tuple[float, int]:
    """(cached share of prompt tokens after turn 1, agents whose every later turn hit the
    KV of its previous turn, i.e. stayed on one replica)."""
    prompt = sum(m["prompt_tokens"] for agent in metas for m in agent[1:])
    cached = sum(m["cached_tokens"] for agent in metas for m in agent[1:])
    stayed = sum(all(agent[t]["cached_tokens"] >= agent[t - 1]["prompt_tokens"] - 32
                     for t in range(1, NUM_TURNS)) for agent in metas)
    return cached / prompt, stayed


@pytest.mark.slow
def test_cache_aware_keeps_agents_on_their_replica(tiny_model_4k, tmp_path):
    """Each agent's later turns hit the KV of its previous turn: it stayed on one replica.
    (No round-robin baseline: how often round robin sends an agent's next turn back to the
    same replica depends on how the agents' requests interleave, i.e. on timing.)"""
    server = launch_server(*FLAGS, "--dp-size", "2", "--router-policy", "cache_aware",
                           model_path=tiny_model_4k)
    try:
        workers = _worker_urls(server.base_url)
        assert len(workers) == 2, server.log_tail()
        metas = _run_agents(server.base_url)
        share = [_finished(w) / (NUM_AGENTS * NUM_TURNS) for w in workers]
        harness = _run_harness(server.base_url, tiny_model_4k, tmp_path)
    finally:
        server.stop()
    hit, stayed = _score(metas)
    print("cached share after turn 1, agents kept:", hit, stayed)
    # the launcher's balance thresholds may move an agent whose replica is the busier one (a
    # whole batch on the other replica finishing at once leaves it idle)
    assert stayed >= NUM_AGENTS - 2, (hit, stayed)
    assert hit >= 0.85, (hit, stayed)
    assert all(0.25 <= s <= 0.75 for s in share), share
    # the agent harness drives the replicas like any server
    react = harness["runs"]["server"]["react"]
    assert react["requests"] == 6 and react["requests_failed"] == 0, react["errors"]
    assert react["cache_hit_rate"] > 0.5
    assert sum(react["replica_requests"]) == 6, react  # its per-replica split, from /workers


SHARED_TURNS = 3


def _shared_system_prompt() -> str:
    """About 1,000 tokens of the default model's tokenizer, the same for every agent."""
    tools = ["search", "read_file", "write_file", "run_tests", "list_dir", "grep", "diff"]
    lines = [f"Tool {i}: {tools[i % 7]}(arg{i}) returns result {i * 37 % 101} of kind {i % 5}."
             for i in range(44)]
    return "You are a coding agent with these tools.\n" + "\n".join(lines) + "\n"


def _run_shared_agents(url: str, header: bool) -> list[list[dict]]:
    """8 agents x SHARED_TURNS turns over one system prompt, all in flight at once; each names
    its session in `session_params.id` (and in the routing header when `header`)."""
    system = _shared_system_prompt()

    def agent(a: int) -> list[dict]:
        text, metas = system + f"Task {a}: fix bug #{a * 113} in module m{a}.\n", []
        headers = {"X-SMG-Routing-Key": f"agent-{a}"} if header else {}
        for turn in range(SHARED_TURNS):
            resp = requests.post(url + "/generate", timeout=300, headers=headers, json={
                "text": text, "session_params": {"id": f"agent-{a}"},
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            resp.raise_for_status()
            out = resp.json()
            metas.append(out["meta_info"])
            text += out["text"] + f"\nObservation {turn}: {a * 10 + turn} tests pass.\n"
        return metas

    with concurrent.futures.ThreadPoolExecutor(NUM_AGENTS) as pool:
        return list(pool.map(agent, range(NUM_AGENTS)))


def _kept(metas: list[list[dict]]) -> list[bool]:
    """Per agent: every later turn was served from the KV of its previous turn."""
    return [all(agent[t]["cached_tokens"] >= agent[t - 1]["prompt_tokens"] - 32
                for t in range(1, len(agent))) for agent in metas]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cache_aware", "manual"])
def test_agents_sharing_a_system_prompt_spread_over_the_replicas(policy):
    """The launcher's router defaults with agents whose best prefix match is the replica that
    saw the shared system prompt first: cache_aware (the default policy, launcher thresholds)
    and manual (session-keyed by the routing header) each give every replica a fair share, and
    agents keep their own trajectory's hits."""
    flags = ("--dp-size", "2") if policy == "cache_aware" else (
        "--dp-size", "2", "--router-policy", "manual")
    server = launch_server(*DEFAULT_MODEL_FLAGS, *flags)
    try:
        workers = _worker_urls(server.base_url)
        assert len(workers) == 2, server.log_tail()
        metas = _run_shared_agents(server.base_url, header=policy == "manual")
        served = [_finished(w) for w in workers]
    finally:
        server.stop()
    total = NUM_AGENTS * SHARED_TURNS
    hit = sum(m["cached_tokens"] for a in metas for m in a[1:]) / sum(
        m["prompt_tokens"] for a in metas for m in a[1:])
    kept = _kept(metas)
    print(f"{policy}: requests per replica {served}, cached share after turn 1 {hit:.3f}, "
          f"agents that kept their hits {sum(kept)} of {NUM_AGENTS}")
    assert sum(served) == total and min(served) >= total // 4, served
    assert hit >= 0.9, hit
    if policy == "manual":
        assert all(kept), [[(m["prompt_tokens"], m["cached_tokens"]) for m in a] for a in metas]
    else:  # balancing may move an agent whose replica is the busier one by > the threshold
        assert sum(kept) >= NUM_AGENTS - 2, kept


def _run_harness(url: str, model: str, tmp_path: Path) -> dict:
    out = tmp_path / "agent_loop.json"
    agent_loop_main(["--base-url", url, "--model-path", model, "--workloads", "react",
                     "--num-programs", "3", "--turns", "2", "--output-tokens", "4",
                     "--system-tokens", "200", "--observation-tokens", "10",
                     "--warmup-programs", "0", "--no-progress", "--session-hint",
                     "--output", str(out)])
    return json.loads(out.read_text())


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            out += [child, *_children(child)]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _port_free(port: int) -> bool:
    """Bindable as a restarted server binds it (SO_REUSEADDR: TIME_WAIT connections of the
    old one do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_replica_death_under_load_then_sigterm_ends_everything(tiny_model_4k):
    server = launch_server(*FLAGS, "--dp-size", "2", "--router-policy", "round_robin",
                           "--api-key", "sk-test", model_path=tiny_model_4k)
    auth = {"Authorization": "Bearer sk-test"}
    try:
        # the key reaches the replicas' registration probes; clients still need it
        models = requests.get(server.base_url + "/v1/models", headers=auth, timeout=30)
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        assert requests.post(server.base_url + "/generate", json={"text": "Hi"},
                             timeout=30).status_code == 401
        workers = _worker_urls(server.base_url, auth)
        ports = [int(w.rsplit(":", 1)[1]) for w in workers]
        tree = _children(server.proc.pid)
        victim = next(p for p in tree if f"--port {ports[1]}" in _cmdline(p)
                      and "sgl_tpu.launch_server" in _cmdline(p))

        def one(i: int) -> int:
            try:
                body = {"text": f"request {i}: The quick brown fox",
                        "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
                return requests.post(server.base_url + "/generate", json=body, headers=auth,
                                     timeout=120).status_code
            except requests.RequestException:
                return -1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(40)]
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            codes = [f.result() for f in futures]
        failed = sum(c != 200 for c in codes)
        print(f"requests failed when a replica was killed: {failed} of {len(codes)}")
        assert failed <= 6, codes
        # after the death the survivor serves everything
        for i in range(4):
            assert one(100 + i) == 200
        deadline = time.monotonic() + 10
        died = f"replica 1 (port {ports[1]}) died"
        while died not in server.log_tail(10**6) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert died in server.log_tail(10**6)

        tree = [p for p in _children(server.proc.pid) if Path(f"/proc/{p}").exists()]
        router_port = int(server.base_url.rsplit(":", 1)[1])
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 20
        time.sleep(0.5)
        alive = [p for p in tree if Path(f"/proc/{p}").exists()
                 and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]]
        assert alive == [], [_cmdline(p) for p in alive]
        assert _port_free(router_port) and _port_free(ports[0])
    finally:
        server.stop()


@pytest.mark.slow
def test_a_failing_replica_fails_the_launch(tmp_path):
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_tpu.launch_server", "--dp-size", "2", "--port", str(port),
         "--model-path", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode != 0
    assert "cannot load --model-path" in proc.stderr
    assert "exited with code 1 before it was ready" in proc.stderr
    assert _port_free(port)


def test_server_args_default_is_one_replica():
    assert ServerArgs().dp_size == 1 and parse_args([]).router_args == ()
    with pytest.raises(ValueError, match="launch_server --dp-size"):
        Engine(dp_size=2)  # refused before a model loads
