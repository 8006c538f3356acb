"""SGLang frontend programs (`import sglang as sgl`, the real PyPI package, unmodified) against a
real sgl-tpu server: gen with stops, select, dtype/regex/json_schema constraints, fork/join,
run_batch, chat roles, streaming, flush_cache/get_server_info, bad input; the `examples/dsl_*.py`
scripts; then the package's own frontend test programs (`sglang/test/test_programs.py`).

One server serves the whole module (the default model, SmolLM2-135M-Instruct, ChatML: the
session's float32 server of tests/conftest.py, shared with tests/test_agent_api.py). The
programs written here sample greedily, so the assertions are about the server's behaviour, not
luck; where an assertion depends on what the model knows, the context states the answer.

Tests marked `backend_independent` run on the default executor backend only (`make test`'s JAX
pass deselects them): the `/get_model_info` mapping is the HTTP process's; a grammar error, a
flush and `/server_info` are answered by the host processes; fork/join's and run_batch's cache
hits and concurrency are the scheduler's (on JAX, tests/test_server_native.py compares cache
hits and 64 concurrent streams token for token); and the example scripts and SGLang's own test
programs make the calls this module's other programs make on JAX too (gen with stops, select,
chat turns streamed, regex, JSON-schema and typed fields); what they add is their own output.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import requests
from server_harness import REPO_ROOT, ServerHandle
from sglang_frontend import sgl

pytestmark = pytest.mark.slow

# The server (tests/conftest.py) has few distinct batch shapes (each new one compiles for ~10-20 s
# on first use) and runs float32: SGLang's test programs check a 135M model's answers, and in
# bfloat16 those depend on batch composition (e.g. test_decode_json once drew a raw control
# character inside a JSON string its regex allows); float32 makes them reproducible on either
# backend.
PAGE_SIZE = 16  # the server's default
PROGRAM_TIMEOUT_S = 240.0
# The regexes the frontend sends for dtype=int/float/bool/str.
REGEX_INT, REGEX_FLOAT = sgl.lang.ir.REGEX_INT, sgl.lang.ir.REGEX_FLOAT
REGEX_BOOL, REGEX_STR = sgl.lang.ir.REGEX_BOOL, sgl.lang.ir.REGEX_STR


@pytest.fixture(scope="module")
def server(default_model_server_f32) -> ServerHandle:
    return default_model_server_f32


@pytest.fixture(scope="module")
def backend(server: ServerHandle):
    """The frontend's backend, chat template picked from `/get_model_info` (no override)."""
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    sgl.set_default_backend(endpoint)
    return endpoint


# ---- the chat template the frontend picks ----------------------------------------------------

@pytest.mark.backend_independent
def test_model_info_maps_to_chatml(server: ServerHandle, backend) -> None:
    info = requests.get(server.base_url + "/get_model_info", timeout=30).json()
    assert backend.chat_template.name == "chatml", info["model_path"]
    assert info["tokenizer_path"].endswith(".gguf")
    assert info["model_path"].startswith(info["tokenizer_path"])


@sgl.function
def two_turn_chat(s, first: str, second: str):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=24))
    with s.user():
        s += second
    with s.assistant():
        s += sgl.gen("answer_2", max_tokens=24)


def test_chat_roles_render_chatml(backend) -> None:
    st = two_turn_chat.run(first="Name a colour.", second="Name another one.", temperature=0)
    assert st.error() is None
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user",
                                                  "assistant"]
    a1, a2 = st["answer_1"], st["answer_2"]
    for answer in (a1, a2):
        assert isinstance(answer, str) and answer
        assert "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert st.text() == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        f"<|im_start|>assistant\n{a1}<|im_end|>\n"
        "<|im_start|>user\nName another one.<|im_end|>\n"
        f"<|im_start|>assistant\n{a2}<|im_end|>\n")
    # The template's end string is among the stops: a turn ends at <|im_end|> or at the limit.
    for name in ("answer_1", "answer_2"):
        reason = st.get_meta_info(name)["finish_reason"]
        assert reason["type"] in ("stop", "length"), reason


# ---- gen with stops --------------------------------------------------------------------------

@sgl.function
def repeat_word(s, word: str):
    s += "Repeat the word.\nword: apple\nrepeat: apple\nword: river\nrepeat: river\n"
    s += "word: " + word + "\nrepeat:" + sgl.gen("echo", max_tokens=16, stop="\n")
    s += "\nA sentence about it:" + sgl.gen("sentence", max_tokens=24, stop=[".", "\n"])


def test_gen_stops(backend) -> None:
    st = repeat_word.run(word="mountain", temperature=0)
    assert st.error() is None
    assert st["echo"].strip() == "mountain"
    meta = st.get_meta_info("echo")
    assert meta["finish_reason"] == {"type": "stop", "matched": "\n"}
    sentence = st["sentence"]
    assert "." not in sentence and "\n" not in sentence
    assert st.get_meta_info("sentence")["finish_reason"]["type"] in ("stop", "length")


# ---- select ----------------------------------------------------------------------------------

@sgl.function
def secret_colour(s, colour: str):
    s += f"The secret colour is {colour}. Remember it.\n"
    s += "Q: What is the secret colour?\nA: The secret colour is"
    s += sgl.select("colour", [" red", " green", " blue", " yellow"])


@sgl.function
def pick_tool(s, request: str):
    s += "Tools: calculator (for arithmetic), weather (for forecasts), search (for facts).\n"
    s += "Request: What is 12 times 7?\nTool: calculator\n"
    s += "Request: Will it rain in Paris tomorrow?\nTool: weather\n"
    s += "Request: " + request + "\nTool:"
    s += sgl.select("tool", [" calculator", " weather", " search"])


def test_select_follows_context(backend) -> None:
    """Every colour is named in the context, so a scoring error (misaligned log-prob positions,
    wrong tokenisation between the calls) picks a wrong one."""
    for colour in ("red", "green", "blue", "yellow"):
        st = secret_colour.run(colour=colour)
        assert st.error() is None
        assert st["colour"] == f" {colour}", st.get_meta_info("colour")
    meta = st.get_meta_info("colour")
    assert len(meta["normalized_prompt_logprobs"]) == 4
    st = pick_tool.run(request="What is 45 plus 19?")
    assert st["tool"] in (" calculator", " weather", " search")


# ---- constrained decoding: dtype, regex, json_schema -----------------------------------------

@sgl.function
def typed_answers(s):
    s += "Q: How many legs does a cat have?\nA: " + sgl.gen_int("legs", max_tokens=6) + "\n"
    s += "Q: What is half of five?\nA: " + sgl.gen("half", dtype=float, max_tokens=8) + "\n"
    s += "Q: Is water wet?\nA: " + sgl.gen("wet", dtype=bool) + "\n"
    s += "Q: Name a fruit.\nA: " + sgl.gen("fruit", dtype=str, max_tokens=12) + "\n"


def test_dtype_gen(backend) -> None:
    st = typed_answers.run(temperature=0)
    assert st.error() is None, st.error()
    # The frontend strips the " "/"\n" stop it adds for numbers; the rest must match exactly.
    assert re.fullmatch(REGEX_INT, st["legs"]), st["legs"]
    int(st["legs"])
    assert re.fullmatch(REGEX_FLOAT, st["half"]), st["half"]
    float(st["half"])
    assert re.fullmatch(REGEX_BOOL, st["wet"]), st["wet"]
    fruit = st["fruit"]
    if st.get_meta_info("fruit")["finish_reason"]["type"] != "length":
        assert re.fullmatch(REGEX_STR, fruit), fruit


IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
DATE_REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@sgl.function
def regex_fields(s):
    s += "Q: What is the IP address of the Google DNS servers?\nA: "
    s += sgl.gen("ip", regex=IP_REGEX, max_tokens=24) + "\n"
    s += "Q: On what date did the first person walk on the Moon (YYYY-MM-DD)?\nA: "
    s += sgl.gen("date", regex=DATE_REGEX, max_tokens=16) + "\n"


def test_regex(backend) -> None:
    st = regex_fields.run(temperature=0)
    assert st.error() is None, st.error()
    assert re.fullmatch(IP_REGEX, st["ip"]), st["ip"]
    assert re.fullmatch(DATE_REGEX, st["date"]), st["date"]
    assert st.get_meta_info("date")["finish_reason"]["type"] == "stop"


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}


@sgl.function
def city_json(s, city: str):
    s += sgl.user(f"Describe the city of {city} as a JSON object.")
    s += sgl.assistant(sgl.gen("json", json_schema=json.dumps(CITY_SCHEMA), max_tokens=64))


def test_json_schema(backend) -> None:
    st = city_json.run(city="Paris", temperature=0)
    assert st.error() is None, st.error()
    obj = json.loads(st["json"])
    assert set(obj) == {"city", "country", "is_capital"}
    assert isinstance(obj["city"], str) and isinstance(obj["country"], str)
    assert isinstance(obj["is_capital"], bool)


@pytest.mark.backend_independent
@pytest.mark.filterwarnings("ignore:Error in stream_executor")
def test_invalid_regex_reaches_program(server: ServerHandle, backend) -> None:
    """Python-invalid: the frontend raises at `sgl.gen`. Python-valid but beyond the server's
    grammar backend (a backreference): the 400 reaches the program as its error. The server
    keeps serving."""
    @sgl.function
    def unclosed(s):
        s += "Say something: " + sgl.gen("x", regex="(unclosed", max_tokens=4)

    with pytest.raises(re.error):
        unclosed.run()

    @sgl.function
    def backreference(s):
        s += "Say something: " + sgl.gen("x", regex=r"(ab)\1", max_tokens=4)

    st = backreference.run()
    err = st.error()
    assert isinstance(err, RuntimeError), err
    assert "regex" in str(err), err
    assert "x" not in st
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200
    ok = repeat_word.run(word="stone", temperature=0)
    assert ok.error() is None and ok["echo"].strip() == "stone"


# ---- fork / join, run_batch, streaming ---------------------------------------------------------

CITY_FACTS = "".join(
    f"City {i}: {name} has {i + 3} museums, {2 * i + 1} parks and a famous {sight}.\n"
    for i, (name, sight) in enumerate([
        ("Lisbon", "tram"), ("Porto", "bridge"), ("Madrid", "palace"), ("Seville", "tower"),
        ("Valencia", "market"), ("Rome", "forum"), ("Florence", "dome"), ("Venice", "canal"),
        ("Milan", "cathedral"), ("Vienna", "opera"), ("Prague", "castle"), ("Berlin", "gate"),
        ("Munich", "garden"), ("Zurich", "lake"), ("Lyon", "basilica"), ("Nice", "promenade"),
    ]))
SHARED_CONTEXT = "You are planning a trip. Here is what you know about each city.\n" + CITY_FACTS


@sgl.function
def plan_branches(s, cities: list[str]):
    s += SHARED_CONTEXT
    s += "Write one short line about each city you will visit.\n"
    forks = s.fork(len(cities))
    for f, city in zip(forks, cities, strict=True):
        f += f"{city}:" + sgl.gen("line", max_tokens=12, stop="\n")
    forks.join()
    for f, city in zip(forks, cities, strict=True):
        s += f"{city}:{f['line']}\n"
    s += "Best city overall:" + sgl.gen("best", max_tokens=8, stop="\n")
    s.set_var("branch_meta", [f.get_meta_info("line") for f in forks])


@pytest.mark.backend_independent
def test_fork_join_branches_hit_cache(backend) -> None:
    cities = ["Lisbon", "Rome", "Vienna", "Prague", "Munich"]
    st = plan_branches.run(cities=cities, temperature=0)
    assert st.error() is None, st.error()
    lines = st["line"]  # join gathers each branch's variables into lists
    assert len(lines) == len(cities)
    for city, line in zip(cities, lines, strict=True):
        assert isinstance(line, str) and "\n" not in line
        assert f"{city}:{line}\n" in st.text()
    # A hit recomputes at most the branch's own few tokens plus the partly filled last page.
    # `fork` pre-caches the prefix only if the program's worker thread has already appended
    # text when `fork` runs (a race inside the frontend); without it the branches arrive
    # together and the server's in-batch prefix sharing lets one compute it for the others.
    metas = st["branch_meta"]
    hits = [m["cached_tokens"] >= m["prompt_tokens"] - 16 - PAGE_SIZE for m in metas]
    assert sum(hits) >= len(cities) - 1, metas
    assert isinstance(st["best"], str)


@sgl.function
def capital_lookup(s, country: str):
    s += "Capitals: France - Paris. Japan - Tokyo. Kenya - Nairobi. Peru - Lima. "
    s += "Canada - Ottawa. Egypt - Cairo. Spain - Madrid. Chile - Santiago.\n"
    s += "Country: " + country + "\nCapital:" + sgl.gen("capital", max_tokens=6, stop="\n")


@pytest.mark.backend_independent
def test_run_batch_16(backend) -> None:
    capitals = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
                "Canada": "Ottawa", "Egypt": "Cairo", "Spain": "Madrid", "Chile": "Santiago"}
    countries = list(capitals) * 2
    states = capital_lookup.run_batch([{"country": c} for c in countries], temperature=0)
    assert len(states) == 16
    for st in states:
        assert st.error() is None, st.error()
        assert isinstance(st["capital"], str) and "\n" not in st["capital"]
    # The batch's shared prefix was pre-cached by tracing: every program reuses it.
    assert all(st.get_meta_info("capital")["cached_tokens"] >= 32 for st in states)
    copied = sum(st["capital"].strip() == capitals[c]
                 for st, c in zip(states, countries, strict=True))
    assert copied >= 12, [st["capital"] for st in states]


@sgl.function
def story(s, topic: str):
    s += sgl.user(f"Write two sentences about {topic}.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=32))


def test_stream_text_iter(backend) -> None:
    st = story.run(topic="the sea", stream=True, temperature=0)
    chunks = list(st.text_iter("answer"))
    assert len([c for c in chunks if c]) > 1, chunks
    assert "".join(chunks) == st["answer"]
    whole = story.run(topic="the sea", stream=True, temperature=0)
    assert "".join(whole.text_iter()) == whole.text()
    assert st["answer"] == story.run(topic="the sea", temperature=0)["answer"]


@pytest.mark.backend_independent
def test_flush_cache_and_server_info(server: ServerHandle, backend) -> None:
    # `run` returns once the program is queued; `sync` waits for its requests to finish.
    repeat_word.run(word="lantern", temperature=0).sync()
    again = repeat_word.run(word="lantern", temperature=0)
    again.sync()
    assert again.get_meta_info("echo")["cached_tokens"] > 0
    deadline = time.monotonic() + 30
    while True:  # the server refuses to flush while requests run, as SGLang's does
        try:
            sgl.flush_cache()
            break
        except RuntimeError:
            assert time.monotonic() < deadline, "flush_cache refused for 30 s"
            time.sleep(0.5)
    fresh = repeat_word.run(word="lantern", temperature=0)
    fresh.sync()
    assert fresh.get_meta_info("echo")["cached_tokens"] == 0
    info = sgl.get_server_info()
    assert isinstance(info, dict)
    stats = info["stats"]
    assert 0 < stats["cached_tokens"] <= stats["prompt_tokens"]


# ---- examples/dsl_*.py -------------------------------------------------------------------------

@pytest.mark.backend_independent
@pytest.mark.parametrize("script, extra, expect", [
    ("dsl_react_agent.py", [], "-> answer:"),
    ("dsl_fork_join.py", [], "Verdict:"),
    ("dsl_multi_turn_chat.py", ["--stream"], "chat template: chatml"),
    ("dsl_json_output.py", [], "(field by field)"),
])
def test_examples_run(server: ServerHandle, script: str, extra: list[str], expect: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script),
                           "--url", server.base_url, *extra],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expect in proc.stdout, proc.stdout


# ---- SGLang's own frontend test programs ------------------------------------------------------
# Run with answer checks off where the function offers `check_answer`. Left out, with the reason:
SKIPPED_PROGRAMS = {
    "test_decode_json": "json.loads of its output turns on the model's draw, not on the "
                        "server: its string regex admits raw newlines, and max_new_tokens 64 "
                        "can cut a string before its quote. Run as test_decode_json_program "
                        "below, each field checked against its regex",
    "test_few_shot_qa": "asserts world knowledge (US capital: the 135M model answers New York)",
    "test_decode_int": "asserts 24 and 365; under the int regex the 135M model prefers another "
                       "digit to the ' ' stop ('24000...') until max_new_tokens",
    "test_react": "asserts knowledge (where Linus Torvalds lives) beyond a 135M model",
    "test_parallel_encoding": "join(mode='concate_and_append') needs /concate_and_append_request, "
                              "which SGLang's own server (0.5.23) does not serve either; the "
                              "frontend then hangs in join",
    "test_image_qa": "needs a vision model and an image file",
    "test_completion_speculative": "API speculative execution: OpenAI backend only "
                                   "(reads backend.token_usage)",
    "test_chat_completion_speculative": "API speculative execution: OpenAI backend only",
    "test_gen_min_new_tokens": "needs sglang's GPU runtime (sglang.srt) and a Hugging Face "
                               "tokenizer download; reads backend.endpoint (sgl.Runtime only)",
    "test_stream_logprobs": "races inside the frontend: its stream thread keeps only each "
                            "variable's latest meta_info (StreamExecutor._execute_gen), so a "
                            "text_async_iter reader that wakes after several server events gets "
                            "their text with the last event's log-probs only, whatever the "
                            "server sends. Its per-chunk checks run on every event the frontend "
                            "receives in tests/test_stream_logprobs.py",
}
RUN_PROGRAMS = ("test_mt_bench", "test_select", "test_decode_json_regex",
                "test_expert_answer", "test_tool_use", "test_parallel_decoding", "test_stream",
                "test_regex", "test_dtype_gen")


def import_test_programs() -> types.ModuleType:
    """`sglang.test.test_programs`, unmodified. Its module header imports `is_hip` from the GPU
    runtime (`sglang.srt.utils`); when that is not installed, a stand-in answering False serves
    that one import and is removed again."""
    name = "sglang.test.test_programs"
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    saved = {m: sys.modules.pop(m) for m in list(sys.modules)
             if m == "sglang.srt.utils" or m.startswith("sglang.srt.utils.")}
    stand_in = types.ModuleType("sglang.srt.utils")
    stand_in.is_hip = lambda: False
    sys.modules["sglang.srt.utils"] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["sglang.srt.utils"]
        sys.modules.update(saved)


def run_program_test(fn) -> str | None:
    """None when the program's own assertions pass, else the error."""
    kwargs = {"check_answer": False} if "check_answer" in inspect.signature(fn).parameters else {}
    try:
        fn(**kwargs)
    except Exception as e:  # the report names it; the test below fails on it
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def program_results(backend) -> dict[str, str | None]:
    """All of them at once, as the server's concurrent clients (they share the backend)."""
    module = import_test_programs()
    assert set(RUN_PROGRAMS) | set(SKIPPED_PROGRAMS) == {
        n for n, f in vars(module).items() if n.startswith("test_") and callable(f)}
    pool = ThreadPoolExecutor(len(RUN_PROGRAMS))
    futures = {n: pool.submit(run_program_test, getattr(module, n)) for n in RUN_PROGRAMS}
    deadline = time.monotonic() + PROGRAM_TIMEOUT_S
    results = {}
    for n, fut in futures.items():
        try:
            results[n] = fut.result(timeout=max(deadline - time.monotonic(), 1))
        except FutureTimeout:
            results[n] = f"did not finish within {PROGRAM_TIMEOUT_S} s"
    pool.shutdown(wait=False)
    return results


@pytest.mark.backend_independent
@pytest.mark.parametrize("name", [*RUN_PROGRAMS, *(
    pytest.param(n, marks=pytest.mark.skip(reason=r)) for n, r in SKIPPED_PROGRAMS.items())])
def test_sglang_test_programs(name: str, program_results: dict[str, str | None]) -> None:
    assert program_results[name] is None, program_results[name]


@sgl.function
def decode_json(s):
    """SGLang's test_decode_json program, unchanged."""
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
        s += '  "country": ' + sgl.gen_string() + ",\n"
        s += '  "timezone": ' + sgl.gen(dtype=str) + "\n"
        s += "}"


def test_decode_json_program(backend) -> None:
    """Every typed gen holds its regex: ints are digits, strings are quoted word/space runs (a
    string cut by max_new_tokens lacks its closing quote, and the frontend's regex admits raw
    whitespace, so the text is checked field by field rather than with json.loads)."""
    text = decode_json.run(max_new_tokens=64)["json_output"]
    string, integer = r'"[\w\d\s]*"?', r"-?\d+"
    fields = [("name", string), ("population", integer), ("area", integer),
              ("country", string), ("timezone", string)]
    pattern = "\\{\n" + ",\n".join(f'  "{k}": {v}' for k, v in fields) + "\n\\}"
    assert re.fullmatch(pattern, text), text
