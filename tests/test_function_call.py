"""Tool-call parsers, the reasoning splitter and the tool-call grammars, without a server.

Parsers: recorded model outputs per format (several calls, text before/after, malformed calls,
calls cut off by max_tokens) parse to the expected calls, and streaming them in arbitrary chunk
splits gives exactly the non-streaming result. Grammars: random walks through the llguidance
mask (the SmolLM2 tokenizer) only ever produce calls that parse back and validate against the
function's schema.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_tpu.constrained import allowed_token_ids, create_backend
from sgl_tpu.constrained.tool_grammar import json_after_reasoning, tool_call_grammar
from sgl_tpu.function_call import (
    PARSERS,
    CallDelta,
    Text,
    ToolCall,
    ToolCallStream,
    detect_parser,
    get_parser,
    parse_tool_calls,
)
from sgl_tpu.reasoning_parser import ReasoningSplitter, get_reasoning_parser, split_reasoning

WEATHER = {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                   "tags": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "string",
                                                                      "maxLength": 6}}},
                  "required": ["lat"]}},
    "required": ["city", "unit", "days", "where"]}}
NOOP = {"name": "noop", "parameters": {"type": "object", "properties": {}}}
FUNCTIONS = [WEATHER, NOOP]
A1 = {"city": "Paris", "unit": "celsius", "days": 2, "where": {"lat": 48.8}}
A2 = {}

J1 = json.dumps(A1)
H1 = '<tool_call>\n{"name": "get_weather", "arguments": ' + J1 + "}\n</tool_call>"
H2 = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
Q1 = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
      "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
      '<parameter=where>\n{"lat": 48.8}\n</parameter>\n</function>\n</tool_call>')
Q2 = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
CALL1 = ToolCall("get_weather", json.dumps(A1))
A3 = {**A1, "city": "</tool_call>", "where": {"lat": 1, "tags": ["}}"]}}  # markup in strings
H3 = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(A3) + "}\n</tool_call>"
CALL3 = ToolCall("get_weather", json.dumps(A3))
CALL2 = ToolCall("noop", "{}")

# (parser, model output, expected content, expected calls)
RECORDED = [
    ("hermes", "Let me look.\n" + H1 + "\n" + H2 + "\nDone.", "Let me look.\n\n\nDone.",
     [CALL1, CALL2]),
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after", "<tool_call>\n{not json}\n"
     "</tool_call> after", []),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),  # not offered
    ("hermes", "Cut off: " + H1[:40], "Cut off: ", []),  # max_tokens inside a call
    # the closing tag inside an argument string is text, not the block's end
    ("hermes", H3, "", [CALL3]),
    ("hermes", H2 + "\n<tool_", "\n", [CALL2]),  # the next call's marker, cut off: dropped
    ("hermes", "Compare a <", "Compare a <", []),  # no call yet: an ending like a marker's start
    ("qwen25", H2, "", [CALL2]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": ' + J1 + "}; "
     '{"name": "noop", "parameters": {}}', "", [CALL1, CALL2]),
    ("llama3", '{"name": "noop", "parameters": {}}', "", [CALL2]),
    ("llama3", 'The JSON {"name": "noop", "parameters": {}} is text here.',
     'The JSON {"name": "noop", "parameters": {}} is text here.', []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + J1 + "}, "
     '{"name": "noop", "arguments": {}}]', "Sure. ", [CALL1, CALL2]),
    ("mistral", "[TOOL_CALLS] [{broken}] x", "[TOOL_CALLS] [{broken}] x", []),
    ("mistral", '[TOOL_CALLS] [{"name": "noop", "argu', "", []),  # cut off: dropped
    ("pythonic", 'I will call [get_weather(city="Paris", unit="celsius", days=2, '
     'where={"lat": 48.8}), noop()] now.', "I will call  now.", [CALL1, CALL2]),
    ("pythonic", "A list [1, 2] and [note] stay text.", "A list [1, 2] and [note] stay text.",
     []),
    ("pythonic", "[noop(), print(1 + )]", "[noop(), print(1 + )]", []),
    ("qwen3_coder", "Checking.\n" + Q1 + "\n" + Q2, "Checking.\n\n", [CALL1, CALL2]),
    ("qwen3_coder", "<tool_call>\n<func>bad</func>\n</tool_call>",
     "<tool_call>\n<func>bad</func>\n</tool_call>", []),
]


def _stream(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[ToolCall]]:
    """Streamed result; calls streamed in parts (CallDelta) must add up to the whole call."""
    stream = ToolCallStream(get_parser(parser_name), FUNCTIONS)
    events, prev = [], 0
    for cut in [*cuts, len(text)]:
        events += stream.feed(text[prev:cut])
        prev = cut
    events += stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    open_call = None
    for e in events:
        if isinstance(e, CallDelta):
            if e.name is not None:
                open_call = [e.name, ""]
            else:
                open_call[1] += e.arguments
        elif isinstance(e, ToolCall) and open_call is not None:
            assert e.name == open_call[0] and e.arguments.startswith(open_call[1])
            open_call = None
    return "".join(e.text for e in events if isinstance(e, Text)), calls


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_recorded_outputs(name, text, content, calls):
    got_content, got_calls = parse_tool_calls(get_parser(name), text, FUNCTIONS)
    assert got_calls == calls
    assert got_content == content
    for call in got_calls:  # every call's arguments are JSON valid against the schema
        fn = {f["name"]: f for f in FUNCTIONS}[call.name]
        jsonschema.validate(json.loads(call.arguments), fn["parameters"])


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_streaming_matches_non_streaming(name, text, content, calls):
    rng = random.Random(hash(text) & 0xFFFF)
    for step in (1, 2, 3, 5, 7):
        assert _stream(name, text, list(range(step, len(text), step))) == (content, calls)
    for _ in range(20):  # arbitrary chunk boundaries
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        assert _stream(name, text, cuts) == (content, calls)


_PIECES = ["<tool_call>", "</tool_call>", "\n", '{"name": "noop", "arguments": {}}',
           '{"name": "get_weather", "arguments": {"city": "Oslo"', "}", "{", "[", "]", '"',
           "\\", "<|python_tag|>", "[TOOL_CALLS]", " [", "noop()", "get_weather(city='x')", ";",
           "<function=noop>", "</function>", "<parameter=city>", "</parameter>", "<think>",
           "</think>", "text ", "(", ")", ",", "[" * 50]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["hermes", "llama3", "mistral", "pythonic", "qwen3_coder"]),
       st.lists(st.sampled_from(_PIECES), max_size=25), st.lists(st.integers(1, 400),
                                                                 max_size=8))
def test_any_text_streams_like_it_parses(name, pieces, cuts):
    """Whatever the model writes: no exception, stream == non-stream on any split, every call
    names an offered function with a JSON object as arguments."""
    text = "".join(pieces)
    content, calls = parse_tool_calls(get_parser(name), text, FUNCTIONS)
    cuts = sorted({c for c in cuts if c < len(text)})
    assert _stream(name, text, cuts) == (content, calls)
    for call in calls:
        assert call.name in {"get_weather", "noop"}
        assert isinstance(json.loads(call.arguments), dict)


def test_hermes_streams_arguments_as_written():
    stream = ToolCallStream(get_parser("hermes"), FUNCTIONS)
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arg') == []
    assert stream.feed('uments": {"city": "Pa') == [CallDelta("get_weather", ""),
                                                  CallDelta(None, '{"city": "Pa')]
    assert stream.feed('ris"}}\n</tool') == [CallDelta(None, 'ris"}')]
    assert stream.feed('_call>') == [ToolCall("get_weather", '{"city": "Paris"}')]
    # a call the output ends inside leaves its parts and no ToolCall
    stream = ToolCallStream(get_parser("hermes"), FUNCTIONS)
    events = stream.feed('<tool_call>\n{"name": "noop", "arguments": {"x') + stream.finish()
    assert events == [CallDelta("noop", ""), CallDelta(None, '{"x')]


def test_stream_never_shows_markup_prefix():
    """Text that could still be a marker is held back, then released when it is not one."""
    stream = ToolCallStream(get_parser("hermes"), FUNCTIONS)
    assert stream.feed("Hello <tool") == [Text("Hello ")]
    assert stream.feed("box>") == [Text("<toolbox>")]
    assert stream.feed(H2[:20]) == []
    assert stream.feed(H2[20:]) == [CALL2]  # complete at once: no parts first


def test_registry_and_detection():
    assert {"hermes", "qwen25", "llama3", "mistral", "pythonic", "qwen3_coder"} <= set(PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("nope")
    assert detect_parser("{{ '<tool_call>' }}")[0] == "qwen25"
    assert detect_parser("<tool_call><function=x>")[0] == "qwen3_coder"
    assert detect_parser("[TOOL_CALLS]")[0] == "mistral"
    assert detect_parser("<|python_tag|>")[0] == "llama3"
    assert detect_parser("{{ message['content'] }}")[0] == "hermes"
    assert detect_parser(None)[0] == "hermes"


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "pythonic", "qwen3_coder"])
def test_render_calls_parse_back(name):
    parser = get_parser(name)
    text = parser.render_calls([("get_weather", A1), ("noop", A2)])
    content, calls = parse_tool_calls(parser, text, FUNCTIONS)
    assert calls == [CALL1, CALL2] and content.strip() == ""
    assert parser.instructions in parser.tools_prompt(FUNCTIONS)


# ---- reasoning ---------------------------------------------------------------------------
REASONING = [
    ("qwen3", "<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4.", False,
     "Let me add.\n2+2=4", "\n\nThe answer is 4."),
    ("qwen3", "No block here.", False, None, "No block here."),
    ("deepseek-r1", "Hmm, 4.</think>It is 4.", True, "Hmm, 4.", "It is 4."),
    ("deepseek-r1", "Cut off while thinking", True, "Cut off while thinking", ""),
    ("qwen3", "<think>opened by the template</think>ok", True, "opened by the template", "ok"),
]


@pytest.mark.parametrize("name, text, inside, reasoning, content", REASONING)
def test_reasoning_split(name, text, inside, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.starts_in_reasoning("<|im_start|>assistant\n<think>\n") is True
    assert split_reasoning(text, inside) == (reasoning, content)
    for step in (1, 2, 3, 4):
        s, r, c = ReasoningSplitter(inside), "", ""
        for i in range(0, len(text), step):
            dr, dc = s.feed(text[i:i + step])
            r, c = r + dr, c + dc
            assert "</th" not in dr and "<thi" not in dc  # no marker halves shown
        dr, dc = s.finish()
        assert (r + dr).strip() == (reasoning or "") and c + dc == content


# ---- grammars ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend():
    from sgl_tpu.loader import default_model_path, load_tokenizer

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(None)
    short = np.array([len(tok.decode([t])) <= 2 for t in range(tok.vocab_size)])
    return tok, create_backend("llguidance", tok, tok.vocab_size), short


def _walk(backend, compiled, prefix: str, rng: random.Random, max_steps: int = 400) -> str:
    """Random tokens through the mask (EOS preferred once allowed): text the grammar admits."""
    tok, _, short_ids = backend
    matcher = compiled.new_matcher()
    row = np.zeros((tok.vocab_size + 31) // 32, np.int32)
    ids = tok.encode(prefix, add_special_tokens=False)
    for t in ids:
        assert matcher.accept_token(t)
    eos = tok.eos_token_ids[0]
    for _ in range(max_steps):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(row)
        allowed = allowed_token_ids(row)
        if eos in allowed and rng.random() < 0.7:
            break
        # short tokens end strings sooner, so most walks finish within max_steps
        short = allowed[short_ids[allowed]]
        t = int(rng.choice(short if len(short) else allowed))
        assert matcher.accept_token(t)
        ids.append(t)
    else:
        return ""
    return tok.decode(ids)


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "pythonic", "qwen3_coder"])
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_grammar_admits_only_valid_calls(backend, name, mode):
    _, be, _ = backend
    parser = get_parser(name)
    compiled = be.compile("ebnf", tool_call_grammar(parser, FUNCTIONS, mode=mode,
                                                    parallel=True))
    rng = random.Random(0)
    prefix = "" if mode == "required" else "Let me check. " + parser.trigger
    finished = 0
    for _ in range(12):
        text = _walk(backend, compiled, prefix, rng)
        if not text:
            continue
        finished += 1
        content, calls = parse_tool_calls(parser, text, FUNCTIONS)
        assert calls, text
        if mode == "required":
            assert content.strip() == "", text
        for call in calls:
            fn = {f["name"]: f for f in FUNCTIONS}[call.name]
            jsonschema.validate(json.loads(call.arguments), fn["parameters"])
    assert finished >= 3


@pytest.mark.parametrize("name", ["hermes", "mistral", "pythonic", "qwen3_coder"])
def test_grammar_follows_defs_refs(backend, name):
    """Pydantic-made schemas (what agent frameworks send) reference `#/$defs/...`."""
    _, be, _ = backend
    fn = {"name": "add_item", "parameters": {
        "$defs": {"Item": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1,
                                                               "maximum": 5}},
            "required": ["sku", "qty"]}},
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"]}}
    parser = get_parser(name)
    compiled = be.compile("ebnf", tool_call_grammar(parser, [fn], mode="required",
                                                    parallel=False))
    rng, done = random.Random(5), 0
    for _ in range(6):
        text = _walk(backend, compiled, "", rng)
        if text:
            done += 1
            calls = parse_tool_calls(parser, text, [fn])[1]
            assert len(calls) == 1, text
            jsonschema.validate(json.loads(calls[0].arguments), fn["parameters"])
    assert done


def test_grammar_named_and_single(backend):
    _, be, _ = backend
    parser = get_parser("hermes")
    lark = tool_call_grammar(parser, [NOOP], mode="required", parallel=False)
    text = _walk(backend, be.compile("ebnf", lark), "", random.Random(1))
    assert parse_tool_calls(parser, text, FUNCTIONS) == ("", [CALL2])


def test_grammar_starts_after_reasoning(backend):
    _, be, _ = backend
    parser = get_parser("hermes")
    lark = tool_call_grammar(parser, FUNCTIONS, mode="required", parallel=False,
                             reasoning="inside")
    compiled = be.compile("ebnf", lark)
    text = _walk(backend, compiled, "free <tool_call> thoughts</think>\n", random.Random(2))
    reasoning, rest = split_reasoning(text, True)
    assert reasoning == "free <tool_call> thoughts"
    assert parse_tool_calls(parser, rest, FUNCTIONS)[1]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    text = _walk(backend, be.compile("ebnf", json_after_reasoning(schema, "inside")),
                 "think think</think>", random.Random(3))
    jsonschema.validate(json.loads(split_reasoning(text, True)[1]), schema)
    # "optional": the model may open a block, or call at once
    lark = tool_call_grammar(parser, FUNCTIONS, mode="required", parallel=False,
                             reasoning="optional")
    compiled = be.compile("ebnf", lark)
    for prefix in ("<think>why</think>", "<tool_call>"):
        text = _walk(backend, compiled, prefix, random.Random(4))
        assert parse_tool_calls(parser, split_reasoning(text, False)[1], FUNCTIONS)[1]


def test_flags():
    from sgl_tpu.choices import check_registry_names
    from sgl_tpu.cli import parse_args
    from sgl_tpu.config import ServerArgs

    args = parse_args(["--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek-r1"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("pythonic", "deepseek-r1")
    assert parse_args([]).tool_call_parser is None
    check_registry_names(args)
    check_registry_names(ServerArgs())  # None: picked from the template / off
    with pytest.raises(ValueError, match="tool_call_parser"):
        check_registry_names(ServerArgs(tool_call_parser="nope"))
    with pytest.raises(ValueError, match="reasoning_parser"):
        check_registry_names(ServerArgs(reasoning_parser="nope"))
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nope"])
