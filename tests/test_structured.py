"""End-to-end tests of structured outputs (regex / JSON schema / EBNF) against real servers.

Servers (launched on first use; a tiny random model unless noted):

    llguidance          default grammar backend: the session's pooled tiny-model server
                        (TINY_F32 in tests/server_harness.py, shared with other modules)
    llguidance_nojf     --disable-jump-forward      (the reference for jump-forward exactness)
    outlines            --grammar-backend outlines
    outlines_nojf       --grammar-backend outlines --disable-jump-forward
    smol                the default SmolLM2 model (the session's server, tests/conftest.py):
                        one realistic OpenAI `response_format` check

The tiny model's outputs are gibberish, but the grammar masks still force every output into the
requested format, so sampled outputs (temperature 1, `n: 20`) are checked against the regex or
schema, and greedy outputs with and without jump-forward are compared token for token.

Tests marked `backend_independent` run on the default executor backend only (`make test`'s JAX
pass deselects them). Grammars compile and jump-forward runs on the host, and every grammar
backend fills the same packed token mask, which the executor applies alike: on JAX the
llguidance cases cover the executor's side, so the outlines cases, the host-side grammar errors,
the kv-pressure case without jump-forward (the retraction path is the same), all but one case of
each list of regexes, schemas and length limits (`_one_on_jax`) and the default-model
`response_format` check (tests/test_frontend.py runs a JSON schema on that model) run once.

Regexes are checked with the `regex` module, not `re`: both backends give `\\d`, `\\w`, `\\s` the
Unicode (UTS #18) meaning, under which `\\w` also covers combining marks and other alphabetic
symbols (U+0593, U+1F13D, ...) that Python's `re` does not accept.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest
import requests
from server_harness import TINY_F32, ServerHandle, launch_server

regex = pytest.importorskip("regex")

pytestmark = pytest.mark.slow

TIMEOUT = 180  # seconds per HTTP call
BACKENDS = ("llguidance", "outlines")
NUM_SAMPLES = 20
MAX_SAMPLE_TOKENS = 400  # the tiny model's context is 512
PROMPT = "Hello world! How are you today?"
GREEDY = {"temperature": 0.0}
# outlines-core drops integer minimum/maximum (see sgl_tpu/constrained/outlines_backend.py)
OUTLINES_DROPPED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


# ---- servers --------------------------------------------------------------------------------
@dataclass
class Server:
    handle: ServerHandle
    name: str

    @property
    def url(self) -> str:
        return self.handle.base_url

    def post(self, path: str, body: Any, **kw: Any) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=TIMEOUT, **kw)

    def generate(self, **body: Any) -> Any:
        r = self.post("/generate", body)
        assert r.status_code == 200, (r.status_code, r.text, self.handle.log_tail())
        return r.json()

    def info(self) -> dict[str, Any]:
        r = requests.get(self.url + "/server_info", timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict[str, int]:
        return self.info()["stats"]

    def assert_clean(self, timeout: float = 60.0) -> None:
        """Idle, integrity ok and no KV page held by a request."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                    and "integrity" in info):
                break
            assert time.monotonic() < deadline, f"{self.name} not idle: {info}"
            time.sleep(0.05)
        assert info["integrity"] == "ok", info["integrity"]
        assert info["memory"]["num_pages_requests"] == 0, info["memory"]


def _launch(name: str, model_path: str | None, *flags: str) -> Server:
    return Server(launch_server("--skip-warmup", *flags, model_path=model_path), name)


# Outputs with and without jump-forward, or alone and next to other requests, are compared token
# for token: exact in float32 only (see tests/test_server_native.py), so the tiny-model servers
# run float32 on either backend; the default-model server (`smol`) runs the default dtype.
_F32 = ("--dtype", "float32")


_SERVER_FLAGS = {
    "llguidance_nojf": ("--grammar-backend", "llguidance", "--disable-jump-forward"),
    "outlines": ("--grammar-backend", "outlines"),
    "outlines_nojf": ("--grammar-backend", "outlines", "--disable-jump-forward"),
}


@pytest.fixture(scope="module")
def servers(server_pool, tiny_model):
    """name -> Server, each launched the first time a test asks for it ("llguidance": the
    session's pooled one)."""
    launched: dict[str, Server] = {}

    def get(name: str) -> Server:
        if name == "llguidance":
            return Server(server_pool.get(*TINY_F32, model_path=tiny_model), name)
        if name not in launched:
            launched[name] = _launch(name, tiny_model, "--page-size", "16", *_F32,
                                     *_SERVER_FLAGS[name])
        return launched[name]

    yield get
    for server in launched.values():
        server.handle.stop()


@pytest.fixture(params=[b if b == "llguidance" else pytest.param(
    b, marks=pytest.mark.backend_independent) for b in BACKENDS])
def backend(request) -> str:
    return request.param


@pytest.fixture
def server(servers, backend) -> Server:
    return servers(backend)


@pytest.fixture
def server_nojf(servers, backend) -> Server:
    return servers(backend + "_nojf")


@pytest.fixture(scope="module")
def smol(default_model_server) -> Server:
    return Server(default_model_server, "smol")


# ---- helpers --------------------------------------------------------------------------------
def finish_type(out: dict[str, Any]) -> str:
    return out["meta_info"]["finish_reason"]["type"]


def sample(server: Server, grammar: dict[str, str], *, n: int = NUM_SAMPLES,
           max_new_tokens: int = MAX_SAMPLE_TOKENS) -> list[dict[str, Any]]:
    outs = server.generate(text=PROMPT, sampling_params={
        "temperature": 1.0, "max_new_tokens": max_new_tokens, "n": n, **grammar})
    assert isinstance(outs, list) and len(outs) == n
    for o in outs:
        assert finish_type(o) in ("stop", "length"), o["meta_info"]
    return outs


def assert_error(r: requests.Response, *words: str) -> None:
    """A 400 JSON error whose message names every one of `words` (case-insensitive)."""
    assert r.status_code == 400, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and message
    for w in words:
        assert w.lower() in message.lower(), (w, message)


def schema_errors(schema: dict[str, Any], instance: Any) -> list[jsonschema.ValidationError]:
    return list(jsonschema.Draft202012Validator(schema).iter_errors(instance))


def strip_keywords(schema: Any, keywords: frozenset[str]) -> Any:
    if isinstance(schema, dict):
        return {k: strip_keywords(v, keywords) for k, v in schema.items() if k not in keywords}
    if isinstance(schema, list):
        return [strip_keywords(v, keywords) for v in schema]
    return schema


# ---- grammars -------------------------------------------------------------------------------
REGEXES = {
    "ip": r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    "choice": r"(yes|no|maybe)",
    # SGLang's constants for int / float / bool / string (sglang/lang/ir.py)
    "int": r"[-+]?[0-9]+[ \n]*",
    "float": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "bool": r"(True|False)",
    "string": r"\"[\w\d\s]*\"",
}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "nested": _obj({
        "name": {"type": "string", "maxLength": 8},
        "address": _obj({
            "city": {"type": "string", "maxLength": 8},
            "geo": _obj({"lat": {"type": "number"}, "lon": {"type": "number"}}),
        }),
    }),
    "arrays": _obj({
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 4},
        "points": {"type": "array", "maxItems": 3, "items": _obj({
            "x": {"type": "integer"}, "label": {"type": "string", "maxLength": 4}})},
    }),
    "enums": _obj({
        "size": {"type": "string", "enum": ["small", "medium", "large", "extra large"]},
        "level": {"enum": [1, 2, 3, "max", None, True]},
        "unit": {"const": "cm"},
    }),
    "int_bounds": _obj({
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "delta": {"type": "integer", "minimum": -5, "maximum": 5},
    }),
    "bools_strings": _obj({
        "active": {"type": "boolean"},
        "nickname": {"type": "string", "maxLength": 10},
        "code": {"type": "string", "minLength": 2, "maxLength": 4},
        "note": {"type": "string", "maxLength": 6},
    }, required=["active", "nickname", "code"]),
    "top_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 5},
}

# Mostly forced text: jump-forward should skip most decode steps.
FIXED_KEYS_SCHEMA = _obj({
    "status": {"enum": ["success", "failure"]},
    "http_code": {"enum": [200, 404, 500]},
    "category": {"enum": ["electronics", "clothing", "groceries"]},
    "priority": {"enum": ["low", "medium", "high"]},
    "in_stock": {"type": "boolean"},
    "rating": {"enum": [1, 2, 3, 4, 5]},
})

TUPLE_EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" | "yes"'
TUPLE_REGEX = r"\((?:[0-9]|x|yes)(?:,(?:[0-9]|x|yes))*\)"


# ---- 1. sampled outputs match the regex / validate against the schema -----------------------
def _one_on_jax(names: list, kept) -> list:
    """Parameters of cases that differ only in what the host does (the grammar it compiles,
    where a length limit cuts a forced run): on JAX the executor applies every case's token
    mask alike, so `kept` runs there and the rest are `backend_independent`."""
    return [n if n == kept else pytest.param(n, marks=pytest.mark.backend_independent)
            for n in names]


@pytest.mark.parametrize("rx_name", _one_on_jax(list(REGEXES), "ip"))
def test_regex_samples_match(server, rx_name):
    rx = REGEXES[rx_name]
    outs = sample(server, {"regex": rx})
    for o in outs:
        # an output cut at max_new_tokens must still be a prefix of a match (a cut inside a
        # UTF-8 character ends in U+FFFD, the detokenizer's mark for the incomplete bytes)
        partial = finish_type(o) == "length"
        text = o["text"].removesuffix("\ufffd") if partial else o["text"]
        assert regex.fullmatch(rx, text, partial=partial), (o["text"], o["meta_info"])
    num_stop = sum(finish_type(o) == "stop" for o in outs)
    assert num_stop >= 0.8 * len(outs), [o["meta_info"]["completion_tokens"] for o in outs]
    assert len({o["text"] for o in outs}) > 1  # really sampled
    server.assert_clean()


@pytest.mark.parametrize("schema_name", _one_on_jax(list(SCHEMAS), "nested"))
def test_json_schema_samples_validate(server, backend, schema_name):
    schema = SCHEMAS[schema_name]
    outs = sample(server, {"json_schema": json.dumps(schema)})
    finished = [o for o in outs if finish_type(o) == "stop"]
    assert len(finished) >= 0.8 * len(outs), [o["meta_info"]["completion_tokens"] for o in outs]
    bound_violations = 0
    for o in finished:
        value = json.loads(o["text"])  # compact, no trailing text
        errors = schema_errors(schema, value)
        if backend == "outlines" and errors:
            # the documented limitation and nothing else
            assert {e.validator for e in errors} <= OUTLINES_DROPPED, (o["text"], errors)
            assert not schema_errors(strip_keywords(schema, OUTLINES_DROPPED), value)
            bound_violations += 1
        else:
            assert not errors, (o["text"], [e.message for e in errors])
    if schema_name == "int_bounds" and backend == "outlines":
        # random digits at temperature 1 leave [18, 99] x [-5, 5] almost surely
        assert bound_violations > 0, "outlines now enforces integer bounds: update the docs"
    assert len({o["text"] for o in outs}) > 1
    server.assert_clean()


def test_ebnf_samples_llguidance(servers):
    server = servers("llguidance")
    outs = sample(server, {"ebnf": 'root ::= "yes" | "no"'})
    assert {o["text"] for o in outs} <= {"yes", "no"}
    assert all(finish_type(o) == "stop" for o in outs)
    outs = sample(server, {"ebnf": TUPLE_EBNF})
    for o in outs:
        assert regex.fullmatch(TUPLE_REGEX, o["text"], partial=finish_type(o) == "length"), o
    assert sum(finish_type(o) == "stop" for o in outs) >= 0.8 * len(outs)
    server.assert_clean()


# ---- 2. jump-forward is exact and saves decode steps ----------------------------------------
JF_GRAMMARS: list[dict[str, str]] = (
    [{"json_schema": json.dumps(s)} for s in (*SCHEMAS.values(), FIXED_KEYS_SCHEMA)]
    + [{"regex": rx} for rx in REGEXES.values()]
    + [{"regex": r"The answer is (yes|no|maybe)\. Confidence: [0-9]{2}%"},
       {"regex": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"}]
)
JF_PROMPTS = [PROMPT, "The quick brown fox", "def add(a, b):"]


def _run_grammars(server: Server, grammars: list[dict[str, str]], **sp: Any
                  ) -> tuple[list[list[dict[str, Any]]], dict[str, int]]:
    before = server.stats()
    results = []
    for g in grammars:
        outs = server.generate(text=JF_PROMPTS, sampling_params={
            "max_new_tokens": MAX_SAMPLE_TOKENS, **sp, **g})
        results.append(outs)
    after = server.stats()
    return results, {k: after[k] - before[k] for k in after}


def _key(outs: list[dict[str, Any]]) -> list[tuple]:
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"],
             o["meta_info"]["completion_tokens"]) for o in outs]


def test_jump_forward_greedy_identical_and_saves_steps(server, server_nojf):
    jf, jf_delta = _run_grammars(server, JF_GRAMMARS, **GREEDY)
    ref, ref_delta = _run_grammars(server_nojf, JF_GRAMMARS, **GREEDY)
    for g, a, b in zip(JF_GRAMMARS, jf, ref, strict=True):
        assert _key(a) == _key(b), g
    # the same tokens, some of them forced, appended without a decode step. (The step counts of
    # these mixed grammars also move with speculation: on the reference server drafts of the
    # forced text are kept, which raises the acceptance rate new requests start from.)
    assert jf_delta["generated_tokens"] == ref_delta["generated_tokens"] > 0
    assert jf_delta["jump_forward_tokens"] > 0 == ref_delta["jump_forward_tokens"]
    # the fixed-keys schema is mostly forced
    fixed = {"json_schema": json.dumps(FIXED_KEYS_SCHEMA)}
    _, d_jf = _run_grammars(server, [fixed], **GREEDY)
    _, d_ref = _run_grammars(server_nojf, [fixed], **GREEDY)
    assert d_jf["num_decode_steps"] * 3 <= d_ref["num_decode_steps"], (d_jf, d_ref)
    server.assert_clean()
    server_nojf.assert_clean()


def test_jump_forward_seeded_sampling_identical(server, server_nojf):
    """The RNG is keyed by output position, so seeded sampling is unchanged too."""
    grammars = [{"json_schema": json.dumps(SCHEMAS["nested"])},
                {"json_schema": json.dumps(FIXED_KEYS_SCHEMA)}, {"regex": REGEXES["ip"]}]
    jf, _ = _run_grammars(server, grammars, temperature=1.0, seed=1234)
    ref, _ = _run_grammars(server_nojf, grammars, temperature=1.0, seed=1234)
    for g, a, b in zip(grammars, jf, ref, strict=True):
        assert _key(a) == _key(b), g


@pytest.mark.parametrize("max_new_tokens", _one_on_jax([1, 2, 3, 5, 8, 13], 5))
def test_jump_forward_respects_max_new_tokens(server, server_nojf, max_new_tokens):
    sp = {**GREEDY, "max_new_tokens": max_new_tokens,
          "json_schema": json.dumps(FIXED_KEYS_SCHEMA)}
    a = server.generate(text=JF_PROMPTS, sampling_params=sp)
    b = server_nojf.generate(text=JF_PROMPTS, sampling_params=sp)
    assert _key(a) == _key(b)
    for o in a:
        assert o["meta_info"]["completion_tokens"] == max_new_tokens
        assert finish_type(o) == "length"


def test_jump_forward_stop_string_inside_forced_text(server, server_nojf):
    sp = {**GREEDY, "max_new_tokens": 100, "json_schema": json.dumps(FIXED_KEYS_SCHEMA)}
    for stop in (['"category"'], ["priority"], [":"]):
        a = server.generate(text=JF_PROMPTS, sampling_params={**sp, "stop": stop})
        b = server_nojf.generate(text=JF_PROMPTS, sampling_params={**sp, "stop": stop})
        assert _key(a) == _key(b), stop
        for o in a:
            assert finish_type(o) == "stop" and o["meta_info"]["finish_reason"]["matched"] \
                == stop[0], o
            assert stop[0] not in o["text"]


def test_jump_forward_logprobs_and_stream(server, server_nojf):
    sp = {**GREEDY, "max_new_tokens": 100, "json_schema": json.dumps(FIXED_KEYS_SCHEMA)}
    ref = server_nojf.generate(text=PROMPT, sampling_params=sp)
    # logprobs are requested: jump-forward is off for this request; every token has one
    lp = server.generate(text=PROMPT, sampling_params=sp, return_logprob=True)
    assert _key([lp]) == _key([ref])
    assert len(lp["meta_info"]["output_token_logprobs"]) == lp["meta_info"]["completion_tokens"]
    # streamed chunks carry several tokens at once after a jump; the result is the same
    events = []
    with server.post("/generate", {"text": PROMPT, "sampling_params": sp, "stream": True},
                     stream=True) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: "):]))
    assert _key(events[-1:]) == _key([ref])
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and len(events) < counts[-1]  # jumps batched tokens
    for e in events:
        assert ref["text"].startswith(e["text"])
        assert ref["output_ids"][:len(e["output_ids"])] == e["output_ids"]
        assert len(e["output_ids"]) == e["meta_info"]["completion_tokens"], e


def _progress(server: Server) -> int:
    s = server.stats()
    return s["num_extend_steps"] + s["num_decode_steps"] + s["num_requests_finished"]


def _run_concurrently(server: Server, bodies: list[dict[str, Any]], stall_s: float = 8.0
                      ) -> list[dict[str, Any]]:
    """POST every body at once; fail fast if the scheduler stops making progress."""
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        try:
            results[i] = server.post("/generate", bodies[i])
        except requests.RequestException as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    last, last_change = _progress(server), time.monotonic()
    while any(t.is_alive() for t in threads):
        time.sleep(0.25)
        # state first, then the counters: a long step (a JAX compile) that ends between the two
        # reads shows up as progress, not as a stall
        info = server.info()
        now = _progress(server)
        if now != last:
            last, last_change = now, time.monotonic()
        if not any(t.is_alive() for t in threads):
            break
        assert time.monotonic() - last_change < stall_s, (
            f"no progress for {stall_s} s: {info['num_running_reqs']} running, "
            f"{info['num_waiting_reqs']} waiting, {len(results)} of {len(bodies)} answered, "
            f"memory {info['memory']}, stats {info['stats']}\n{server.handle.log_tail()}")
    outs = []
    for i in range(len(bodies)):
        r = results[i]
        assert isinstance(r, requests.Response) and r.status_code == 200, r
        outs.append(r.json())
    return outs


@pytest.mark.parametrize("jump_forward", [
    True,
    pytest.param(False, marks=pytest.mark.backend_independent),
], ids=["jump_forward", "no_jump_forward"])
def test_constrained_under_kv_pressure_matches_roomy(servers, tiny_model, jump_forward):
    """Retraction keeps the grammar state: a tight pool gives the same greedy outputs."""
    ref = servers("llguidance" if jump_forward else "llguidance_nojf")
    # mostly the fixed-keys schema: its forced runs need pages after the first token
    grammars = [{"json_schema": json.dumps(FIXED_KEYS_SCHEMA)}] * 6 + [
        {"json_schema": json.dumps(SCHEMAS["bools_strings"])}, {"regex": REGEXES["ip"]}]
    bodies = [{"text": f"{i} " + "The quick brown fox jumps. " * 4, "sampling_params": {
        **GREEDY, "max_new_tokens": 100, **g}} for i, g in enumerate(grammars)]
    expected = [ref.generate(**body) for body in bodies]
    flags = ["--page-size", "16", "--max-total-tokens", "256", "--max-running-requests", "8",
             *_F32]
    tight = _launch("tight", tiny_model, *flags,
                    *([] if jump_forward else ["--disable-jump-forward"]))
    try:
        outs = _run_concurrently(tight, bodies)
        assert tight.stats()["num_retractions"] > 0
        assert _key(outs) == _key(expected)
        tight.assert_clean()
    finally:
        tight.handle.stop()


# ---- 3. bad grammars are 400s naming the problem; the server keeps serving --------------------
BAD_GRAMMARS = [
    ("regex", "(", ["invalid regex", "("]),
    ("regex", "(?=a)a", ["unsupported grammar feature", "(?=a)a"]),
    ("json_schema", '{"type": "nonsense"}', ["invalid JSON schema", "nonsense"]),
    ("json_schema", "{not json", ["invalid JSON schema", "not valid JSON"]),
    ("json_schema", "[1, 2]", ["invalid JSON schema", "expected an object"]),
]


@pytest.mark.backend_independent
@pytest.mark.parametrize(("kind", "text", "words"), BAD_GRAMMARS,
                         ids=[f"{k}:{t}" for k, t, _ in BAD_GRAMMARS])
def test_bad_grammar_is_400(server, kind, text, words):
    sp = {**GREEDY, "max_new_tokens": 8, kind: text}
    for _ in range(2):  # the failed compile is cached: the second answer is the same
        assert_error(server.post("/generate", {"text": PROMPT, "sampling_params": sp}), *words)
    # a batch with one bad grammar is refused as a whole
    r = server.post("/generate", {"text": [PROMPT, PROMPT], "sampling_params": [
        {**GREEDY, "max_new_tokens": 4, "regex": "(yes|no)"}, sp]})
    assert_error(r, *words)
    out = server.generate(text=PROMPT, sampling_params={
        **GREEDY, "max_new_tokens": 8, "regex": "(yes|no)"})
    assert out["text"] in ("yes", "no")
    server.assert_clean()


@pytest.mark.backend_independent
def test_ebnf_errors(servers):
    sp = {**GREEDY, "max_new_tokens": 8}
    r = servers("outlines").post("/generate", {"text": PROMPT, "sampling_params": {
        **sp, "ebnf": 'root ::= "yes" | "no"'}})
    assert_error(r, "unsupported grammar feature", "ebnf")
    r = servers("llguidance").post("/generate", {"text": PROMPT, "sampling_params": {
        **sp, "ebnf": "root ::= foo"}})
    assert_error(r, "foo")


@pytest.mark.backend_independent
def test_bad_grammar_request_shapes(servers):
    server = servers("llguidance")
    cases = [
        ({"json_schema": {"type": "object"}}, ["json_schema must be a JSON string"]),
        ({"regex": "a", "json_schema": "{}"}, ["only one of regex, json_schema and ebnf"]),
    ]
    for extra, words in cases:
        r = server.post("/generate", {"text": PROMPT, "sampling_params": {
            **GREEDY, "max_new_tokens": 4, **extra}})
        assert_error(r, *words)


def test_bad_grammars_concurrent_with_good_ones(server):
    """Failed compiles finish only their own requests, whatever else is running."""
    good_sp = {**GREEDY, "max_new_tokens": MAX_SAMPLE_TOKENS,
               "json_schema": json.dumps(SCHEMAS["nested"])}
    expected = server.generate(text=PROMPT, sampling_params=good_sp)
    results: dict[int, requests.Response] = {}

    def call(i: int) -> None:
        sp = good_sp if i % 2 == 0 else {**GREEDY, "max_new_tokens": 8,
                                         "regex": f"(unclosed{i}"}
        results[i] = server.post("/generate", {"text": PROMPT, "sampling_params": sp})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in sorted(results.items()):
        if i % 2:
            assert_error(r, "invalid regex", f"unclosed{i}")
        else:
            assert r.status_code == 200, r.text
            assert _key([r.json()]) == _key([expected])
    server.assert_clean()


# ---- 4. constrained and unconstrained requests in one batch ---------------------------------
def test_mixed_batch_matches_alone(server, backend):
    plain = {**GREEDY, "max_new_tokens": 24}
    params = [
        {**GREEDY, "max_new_tokens": 64, "regex": REGEXES["ip"]},
        plain,
        {**GREEDY, "max_new_tokens": 200, "json_schema": json.dumps(SCHEMAS["bools_strings"])},
        {**plain, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 200, "json_schema": json.dumps(FIXED_KEYS_SCHEMA)},
        {**GREEDY, "max_new_tokens": 32, "regex": REGEXES["string"]},
    ]
    if backend == "llguidance":
        params.append({**GREEDY, "max_new_tokens": 64, "ebnf": TUPLE_EBNF})
    prompts = [f"{PROMPT} {i}" for i in range(len(params))]
    batch = server.generate(text=prompts, sampling_params=params)
    alone = [server.generate(text=p, sampling_params=sp) for p, sp in zip(prompts, params,
                                                                         strict=True)]
    assert _key(batch) == _key(alone)
    assert regex.fullmatch(REGEXES["ip"], batch[0]["text"])
    assert not schema_errors(SCHEMAS["bools_strings"], json.loads(batch[2]["text"]))
    server.assert_clean()


# ---- 5. OpenAI response_format ---------------------------------------------------------------
def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_openai_response_format_json_schema(server, backend):
    client = _client(server)
    model = client.models.list().data[0].id
    schema = SCHEMAS["bools_strings"]
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a user as JSON."}],
        response_format=_response_format(schema), temperature=1.0, n=8,
        max_tokens=MAX_SAMPLE_TOKENS - 40)
    assert len(resp.choices) == 8
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        assert not schema_errors(schema, json.loads(choice.message.content))
    # greedy, with the `strict` flag the OpenAI SDK sends
    strict = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                     "schema": FIXED_KEYS_SCHEMA}}
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Report."}], response_format=strict,
        temperature=0.0, max_tokens=200)
    content = resp.choices[0].message.content
    assert not schema_errors(FIXED_KEYS_SCHEMA, json.loads(content)), content
    with pytest.raises(openai.BadRequestError, match="(?i)invalid JSON schema"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format=_response_format({"type": "nonsense"}))
    server.assert_clean()


@pytest.mark.backend_independent
def test_openai_response_format_realistic_smol(smol):
    """The default SmolLM2 model: greedy JSON that validates and ends on its own."""
    client = _client(smol)
    model = client.models.list().data[0].id
    schema = _obj({
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "is_capital": {"type": "boolean"},
    })
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content":
                                "Give facts about Paris, the capital of France, as JSON."}],
        response_format=_response_format(schema), temperature=0.0, max_tokens=60)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert not schema_errors(schema, value), value
    smol.assert_clean()

