"""Multi-LoRA serving (docs/lora.md) with real PEFT adapters (tests/lora_adapters.py).

* In-process `Engine` on a tiny float32 HF checkpoint: one batch mixing two adapters (ranks 4 and
  8, different target modules) and the base model gives, token for token, transformers' greedy
  output of the model with each adapter merged into its float weights; each adapter has its own
  radix-cache namespace (and page-hash seed); bad adapters are refused at load.
* A float32 server of the default model (SmolLM2-135M, its GGUF on the exact kernels, so a
  cached prefix gives the tokens a recomputed one does; the adapters are shaped for it) with
  two adapters at start: the `openai` client names an adapter by `model`, `/v1/models` lists
  them under the model, `/generate` takes `lora_path` (also as SGLang's frontend `Runtime`
  posts it), adapters load and unload while serving (refused while a request uses one), and
  every bad name or folder is a 400 that names it.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import types

import checkpoints as ck
import lora_adapters as la
import numpy as np
import openai
import pytest
import requests
from server_harness import DEFAULT_MODEL_F32_FLAGS, launch_server
from sglang_frontend import sgl  # noqa: F401 (sglang importable without its GPU runtime)

from sgl_tpu import Engine
from sgl_tpu.cli import parse_args
from sgl_tpu.config import ServerArgs
from sgl_tpu.engine import GenerationError
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.lora import parse_lora_paths
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.kv_events import KVEventRecorder
from sgl_tpu.mem_cache.page_hash import ROOT_HASH
from sgl_tpu.mem_cache.radix_cache import RadixCache

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 9, 21, 40, 12], [7, 3, 99, 150, 61, 8, 44, 23, 70], [30, 31, 32, 33, 34]]


# ---- the radix tree's namespaces --------------------------------------------------------------
def test_namespaces_share_no_prefix_and_seed_their_page_hashes():
    alloc = PageAllocator(num_pages=16, page_size=2)
    events = KVEventRecorder()
    tree = RadixCache(alloc, listeners=[events])
    key = np.array([1, 2, 3, 4], np.int32)
    for namespace in (None, "adapter-a", "adapter-b"):
        pages = alloc.alloc(2)
        assert tree.match_prefix(key, namespace).prefix_len == 0  # nothing shared across
        tree.insert(key, alloc.pages_to_slots(pages, 4), namespace=namespace)
        assert tree.match_prefix(key, namespace).prefix_len == 4
    hashes = {ns: tree.match_prefix(key, ns).last_node.hashes.tobytes()
              for ns in (None, "adapter-a", "adapter-b")}
    assert len(set(hashes.values())) == 3  # equal tokens, three chains
    assert tree.root.hashes is None and tree.root.last_hash() is None  # base: ROOT_HASH
    assert hashes[None] != ROOT_HASH
    stored = events.take()  # KV events: three chains of two blocks, each from no parent
    assert [(e.parent_block_hash is None, e.token_ids) for e in stored] == [
        (True, [1, 2]), (False, [3, 4])] * 3
    assert len({e.block_hashes[0] for e in stored}) == 6
    tree.check_integrity()
    assert tree.evict(100) == 12  # every leaf evictable; the namespace roots stay
    assert set(tree.roots) == {"adapter-a", "adapter-b"} and tree.total_size() == 0
    tree.check_integrity()


# ---- flags ------------------------------------------------------------------------------------
def test_flags_take_sglangs_forms_and_refuse_what_lora_cannot_run_on(tmp_path):
    args = parse_args(["--lora-paths", "sql=/a/sql", "/a/chat",
                       '{"lora_name": "x", "lora_path": "/a/x", "pinned": true}',
                       "--max-loras-per-batch", "3", "--lora-target-modules", "q_proj", "v_proj"])
    assert parse_lora_paths(args.lora_paths) == [("sql", "/a/sql"), ("/a/chat", "/a/chat"),
                                                 ("x", "/a/x")]
    assert args.max_loras_per_batch == 3 and args.lora_target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="given twice"):
        ServerArgs(lora_paths=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match=r"\['qkv'\] are not among"):
        ServerArgs(enable_lora=True, lora_target_modules=("qkv",))
    for flags, why in (({"backend": "jax"}, "needs the torch backend"),
                       ({"backend": "torch", "torch_compile": "on"}, "no --torch-compile on"),
                       ({"backend": "torch", "enable_deterministic_inference": True},
                        "no --enable-deterministic-inference")):
        with pytest.raises(ValueError, match=why):
            runner_config(ServerArgs(enable_lora=True, **flags), 1024)
    resolved = runner_config(ServerArgs(backend="torch", enable_lora=True), 1024)
    assert (resolved.max_loras, resolved.max_lora_rank, resolved.compile,
            resolved.static_decode) == (8, 16, False, False)
    assert resolved.lora_target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the Engine on a tiny float checkpoint ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_tiny")
    base = ck.make_tiny_hf_checkpoint(d / "base", "llama")
    return types.SimpleNamespace(
        dir=d, base=base,
        a1=la.make_adapter(d / "a1", base, seed=1, rank=4),
        a2=la.make_adapter(d / "a2", base, seed=2, rank=8, modules=["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def engine(tiny):
    eng = Engine(tiny.base, backend="torch", dtype="float32", torch_compile="off",
                 torch_threads=1, skip_warmup=True, max_total_tokens=1024, page_size=4,
                 max_lora_rank=16, lora_paths=(f"a1={tiny.a1}", f"a2={tiny.a2}"))
    yield eng
    eng.shutdown()


def test_one_batch_of_adapters_and_base_equals_merged_float_models(tiny, engine):
    names = ["a1", None, "a2", "a1", "a2", None]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    folders = {"a1": tiny.a1, "a2": tiny.a2, None: None}
    expected = [la.merged_greedy(tiny.base, folders[n], p, GREEDY["max_new_tokens"])
                for n, p in zip(names, prompts, strict=True)]
    assert [r["output_ids"] for r in results] == expected
    # the same through the model's plain layers (as where the compiled layer ops are not built)
    model = engine.scheduler.runner.model
    fused = model.layer_ops, model.decode_layers
    model.layer_ops = model.decode_layers = None
    try:
        plain = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    finally:
        model.layer_ops, model.decode_layers = fused
    assert [r["output_ids"] for r in plain] == expected
    # the adapters change the output (random non-zero B)
    assert expected[0] != la.merged_greedy(tiny.base, None, prompts[0], 8)
    assert expected[2] != la.merged_greedy(tiny.base, None, prompts[2], 8)


def test_each_adapter_caches_its_prompts_apart(tiny, engine):
    prompt = list(range(40, 60))
    engine.flush_cache()
    cached = [engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
              ["meta_info"]["cached_tokens"] for name in ("a1", None, "a2", "a1")]
    assert cached[:3] == [0, 0, 0]  # no prefix crosses from one adapter (or the base) to another
    assert cached[3] > 0  # but an adapter reuses its own
    tree = engine.scheduler.kv.tree
    assert set(tree.roots) == {engine.scheduler.lora.by_id[i].digest
                               for i in engine.scheduler.lora.ids.values()}
    tree.check_integrity()


def test_load_unload_and_refusals(tiny, engine):
    prompt = PROMPTS[0]
    want = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a1")
    engine.load_lora_adapter("same-as-a1", tiny.a1)  # the same folder: the same namespace
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="same-as-a1")
    assert again["output_ids"] == want["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    engine.unload_lora_adapter("same-as-a1")
    with pytest.raises(GenerationError, match="'same-as-a1' is not loaded"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="same-as-a1")
    with pytest.raises(GenerationError, match="already loaded"):
        engine.load_lora_adapter("a1", tiny.a1)
    with pytest.raises(GenerationError, match="no such adapter folder"):
        engine.load_lora_adapter("gone", str(tiny.dir / "missing"))
    wide = la.make_adapter(tiny.dir / "r32", tiny.base, seed=3, rank=32)
    with pytest.raises(GenerationError, match="rank 32 exceeds --max-lora-rank 16"):
        engine.load_lora_adapter("wide", wide)
    bad = tiny.dir / "bad"
    shutil.copytree(tiny.a1, bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(GenerationError, match="cannot be read"):
        engine.load_lora_adapter("bad", str(bad))
    assert sorted(engine.scheduler.lora.ids) == ["a1", "a2"]
    loaded = engine.get_server_info()["lora_adapters"]
    assert {name: (a["path"], a["rank"]) for name, a in loaded.items()} == {
        "a1": (tiny.a1, 4), "a2": (tiny.a2, 8)}


def test_host_tier_brings_back_each_adapters_own_pages(tiny):
    """A pool too small for both prefixes: they demote to the host tier and load back, each
    into its own namespace (the pages of a1 and of the base model hold different K/V)."""
    eng = Engine(tiny.base, backend="torch", dtype="float32", torch_compile="off",
                 torch_threads=1, skip_warmup=True, max_total_tokens=96, page_size=4,
                 chunked_prefill_size=64, max_running_requests=2, lora_paths=(f"a1={tiny.a1}",),
                 enable_hierarchical_cache=True, hicache_ratio=4, hicache_min_load_tokens=0)
    try:
        prompt = list(range(10, 50))
        first = [engine_out["output_ids"] for engine_out in (
            eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
            for name in ("a1", None))]
        for k in range(6):  # other prompts push both out of the pool
            eng.generate(input_ids=[200 + k + i for i in range(40)], sampling_params=GREEDY)
        for name, want in zip(("a1", None), first, strict=True):
            again = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
            assert again["output_ids"] == want
            assert again["meta_info"]["cached_tokens"] >= 32
        assert eng.get_server_info()["tiers"]["host"]["hit_tokens"] >= 64
        eng.scheduler.kv.tree.check_integrity()
        eng.scheduler.tiers.check()
    finally:
        eng.shutdown()


# ---- a server of the default model ------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_default")
    return types.SimpleNamespace(
        dir=d, **{f"a{i}": la.make_default_model_adapter(d / f"a{i}", seed=i, rank=8)
                  for i in range(3)})


@pytest.fixture(scope="module")
def server(adapters):
    handle = launch_server(*DEFAULT_MODEL_F32_FLAGS, "--max-lora-rank", "8",
                           "--max-loras-per-batch", "4",
                           "--lora-paths", f"a0={adapters.a0}", f"a1={adapters.a1}")
    yield handle
    handle.stop()



def _generate(server, **body) -> requests.Response:
    return requests.post(server.base_url + "/generate", json=body, timeout=120)


@pytest.mark.slow
def test_openai_client_names_an_adapter_by_model(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    base_name = next(name for name, m in models.items() if m.model_extra["parent"] is None)
    assert {n: m.model_extra["parent"] for n, m in models.items() if n != base_name} == {
        "a0": base_name, "a1": base_name}
    assert client.models.retrieve("a1").model_extra["parent"] == base_name

    def chat(model: str) -> str:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three colours."}],
            temperature=0, max_tokens=12)
        assert out.model == model
        return out.choices[0].message.content

    base, a0, a1 = chat(base_name), chat("a0"), chat("a1")
    assert len({base, a0, a1}) == 3
    assert chat("a0") == a0
    # the Responses API runs the same chat: the adapter's answer
    response = client.responses.create(model="a0", input="Name three colours.",
                                       temperature=0, max_output_tokens=12)
    assert response.output_text == a0
    with pytest.raises(openai.BadRequestError, match="a9"):
        chat("a9")
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'a9' is not loaded"):
        client.completions.create(model=f"{base_name}:a9", prompt="hi", max_tokens=2)
    completion = client.completions.create(model=f"{base_name}:a1", prompt="The sky is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text == client.completions.create(
        model="a1", prompt="The sky is", max_tokens=8, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError, match="embeddings are the base model's"):
        client.embeddings.create(model="a0", input="hi")


@pytest.mark.slow
def test_generate_takes_lora_path_per_prompt(server):
    sp = {"temperature": 0, "max_new_tokens": 12}
    r = _generate(server, text=["The sky is"] * 3, lora_path=["a0", None, "a0"],
                  sampling_params=sp)
    assert r.status_code == 200, r.text
    texts = [x["text"] for x in r.json()]
    assert texts[0] == texts[2] != texts[1]
    single = _generate(server, text="The sky is", lora_path="a0", sampling_params=sp)
    assert single.json()["text"] == texts[0]
    # SGLang's frontend `Runtime.generate` posts `lora_path` beside the prompts (its `gen`
    # has no such argument); the request it sends, to this server
    from sglang.lang.backend.runtime_endpoint import Runtime

    posted = json.loads(Runtime.generate(types.SimpleNamespace(url=server.base_url),
                                         ["The sky is", "The sky is"], sp,
                                         lora_path=["a0", None]))
    assert isinstance(posted, list), posted
    assert [x["text"] for x in posted] == texts[:2]
    bad = _generate(server, text="The sky is", lora_path="nope", sampling_params=sp)
    assert bad.status_code == 400 and "'nope' is not loaded" in bad.json()["error"]["message"]


@pytest.mark.slow
def test_adapters_load_and_unload_while_serving(server, adapters):
    url = server.base_url
    load = requests.post(url + "/load_lora_adapter",
                         json={"lora_name": "a2", "lora_path": adapters.a2}, timeout=120)
    assert load.status_code == 200 and load.json()["success"], load.text
    assert load.json()["loaded_adapters"] == {"a0": adapters.a0, "a1": adapters.a1,
                                              "a2": adapters.a2}
    sp = {"temperature": 0, "max_new_tokens": 8}
    assert _generate(server, text="Hello", lora_path="a2", sampling_params=sp).status_code == 200

    def refused(path: str, body: dict, needle: str) -> None:
        r = requests.post(url + path, json=body, timeout=120)
        assert r.status_code == 400 and not r.json()["success"], r.text
        assert needle in r.json()["error_message"]

    refused("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters.dir / "none")},
            "no such adapter folder")
    wide = adapters.dir / "wide"
    shutil.copytree(adapters.a0, wide)
    cfg = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**cfg, "r": 16}))
    refused("/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)},
            "rank 16 exceeds --max-lora-rank 8")
    refused("/load_lora_adapter", {"lora_name": "a0", "lora_path": adapters.a0},
            "already loaded")
    refused("/unload_lora_adapter", {"lora_name": "nope"}, "'nope' is loaded")

    # a request that uses a2 holds it: unloading is refused until it finishes
    long = threading.Thread(target=_generate, kwargs=dict(
        server=server, text="Count: 1, 2, 3,", lora_path="a2",
        sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}))
    long.start()
    deadline = time.monotonic() + 60
    while server.info()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused("/unload_lora_adapter", {"lora_name": "a2"}, "in use by 1 request")
    long.join()
    unload = requests.post(url + "/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
    assert unload.status_code == 200 and unload.json()["loaded_adapters"] == {
        "a0": adapters.a0, "a1": adapters.a1}
    after = _generate(server, text="Hello", lora_path="a2", sampling_params=sp)
    assert after.status_code == 400 and "'a2' is not loaded" in after.text
    assert "a2" not in {m["id"] for m in requests.get(url + "/v1/models").json()["data"]}
    assert server.wait_idle()["memory"]["num_pages_requests"] == 0  # no page leaked
