"""Tests for sgl_tpu.constrained: every grammar backend against the SmolLM2 tokenizer.

Random walks are the core check: at each step fill the mask, pick a uniformly random allowed
token (after WALK_BIAS_STEPS: EOS when allowed, else prefer tokens that close a string, object
or array), accept it, and stop at EOS or termination; the text must then match the regex / parse
and validate against the schema. The model's vocab is padded past the tokenizer's
(PADDED_VOCAB) so masks must keep the extra ids off. Run with -s to see the timing report.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import unicodedata

import jsonschema
import numpy as np
import pytest

from sgl_tpu.constrained import (
    GRAMMAR_BACKENDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarManager,
    allowed_token_ids,
    canonical_forced_tokens,
    create_backend,
)
from sgl_tpu.loader import load_tokenizer

NUM_WALKS = 20
WALK_BIAS_STEPS = 50
WALK_MAX_STEPS = 200
PAD_TOKENS = 64

REGEXES = [
    r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    r"(yes|no|maybe)",
    r"[-+]?[0-9]+[ \n]*",
    r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    r"(True|False)",
    r"\"[\w\d\s]*\"",
]

NAME_AGE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON = {  # six fields: nested object, array, enum, integer bounds, boolean, maxLength
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
SCHEMAS = [NAME_AGE, PERSON, ITEMS]

TUPLE_EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
TUPLE_REGEX = r"\([0-9]+(,[0-9]+)*\)"

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def vocab_info(tok):
    """Per-token facts the walks use: special ids, closers, control bytes."""
    pieces = [tok.id_to_token_bytes(i) for i in range(tok.vocab_size)]
    return {
        "closer": np.array([any(c in p for c in b'"}])') for p in pieces]),
        "control": np.array([any(b < 0x20 for b in p) for p in pieces]),
        "bad_special": np.array(sorted(tok.special_token_ids - set(tok.eos_token_ids))),
        "eos": np.array(sorted(tok.eos_token_ids)),
    }


_backends: dict[str, GrammarBackend] = {}
_compiled: dict[tuple[str, str, str], CompiledGrammar] = {}


def compile_cached(backend: GrammarBackend, kind: str, text: str) -> CompiledGrammar:
    key = (backend.name, kind, text)
    if key not in _compiled:
        _compiled[key] = backend.compile(kind, text)
    return _compiled[key]


@pytest.fixture(scope="module", params=sorted(GRAMMAR_BACKENDS))
def backend(request, tok) -> GrammarBackend:
    name = request.param
    if name not in _backends:
        try:
            _backends[name] = create_backend(name, tok, tok.vocab_size + PAD_TOKENS)
        except GrammarError as e:  # optional backend not installed
            pytest.skip(str(e))
    return _backends[name]


def decode(tok, ids: list[int]) -> str:
    return b"".join(tok.id_to_token_bytes(t) for t in ids).decode("utf-8")


def check_row(backend, tok, info, row: np.ndarray) -> np.ndarray:
    allowed = allowed_token_ids(row)
    assert allowed.size > 0
    assert allowed.max() < tok.vocab_size, "a padded id beyond the tokenizer is allowed"
    assert not np.isin(info["bad_special"], allowed).any(), "a non-EOS special token is allowed"
    return allowed


def random_walk(backend, tok, info, compiled: CompiledGrammar, rng, *, jump_forward=False):
    """Returns (token ids without EOS, whether the walk ended at EOS / termination)."""
    matcher = compiled.new_matcher()
    row = np.zeros(backend.num_mask_words, dtype=np.int32)
    ids: list[int] = []
    for step in range(WALK_MAX_STEPS):
        if jump_forward:
            for t in matcher.forced_tokens():
                assert matcher.accept_token(t), "forced token rejected"
                ids.append(t)
        row[:] = -1
        matcher.fill_bitmask(row)
        allowed = check_row(backend, tok, info, row)
        eos_allowed = allowed[np.isin(allowed, info["eos"])]
        if matcher.is_terminated():
            assert set(allowed) == set(info["eos"]), "terminated but not EOS-only"
        if eos_allowed.size and (step >= WALK_BIAS_STEPS or matcher.is_terminated()):
            token = int(eos_allowed[0])
        else:
            if step >= WALK_BIAS_STEPS and rng.random() < 0.7:
                closers = allowed[info["closer"][allowed]]
                allowed = closers if closers.size else allowed
            token = int(rng.choice(allowed))
        assert matcher.accept_token(token), f"allowed token {token} rejected"
        if token in tok.eos_token_ids:
            assert matcher.is_terminated()
            assert not matcher.accept_token(int(allowed[0]))
            return ids, True
        ids.append(token)
    return ids, False


def regex_fullmatch(regex: str, text: str) -> bool:
    """Python's `re.fullmatch`, except that characters Python's Unicode tables do not know yet
    (the Rust engines' tables are newer) count as members of \\d, \\w and \\s."""
    unknown = "".join(sorted({c for c in text if unicodedata.category(c) == "Cn"}))
    if unknown:
        out, in_class, i = [], False, 0
        while i < len(regex):
            piece = regex[i : i + 2] if regex[i] == "\\" else regex[i]
            i += len(piece)
            if piece in ("\\d", "\\w", "\\s"):
                piece += re.escape(unknown)
                piece = piece if in_class else f"[{piece}]"
            elif piece in ("[", "]"):
                in_class = piece == "["
            out.append(piece)
        regex = "".join(out)
    return re.fullmatch(regex, text) is not None


def strip_integer_bounds(schema):
    """The schema as outlines enforces it: integer minimum/maximum dropped."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node.pop("minimum", None)
                node.pop("maximum", None)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


# ---------------------------------------------------------------------------- random walks


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_random_walks(backend, tok, vocab_info, regex):
    compiled = backend.compile("regex", regex)
    rng = np.random.default_rng(0)
    for _ in range(NUM_WALKS):
        ids, ended = random_walk(backend, tok, vocab_info, compiled, rng)
        text = decode(tok, ids)
        assert ended, f"walk did not end: {text!r}"
        assert regex_fullmatch(regex, text), f"{backend.name}: {text!r} !~ {regex}"


@pytest.mark.parametrize("schema", SCHEMAS, ids=["name_age", "person", "items"])
def test_json_schema_random_walks(backend, tok, vocab_info, schema):
    compiled = compile_cached(backend, "json_schema", json.dumps(schema))
    enforced = strip_integer_bounds(schema) if backend.name == "outlines" else schema
    rng = np.random.default_rng(1)
    for i in range(NUM_WALKS):
        ids, ended = random_walk(backend, tok, vocab_info, compiled, rng, jump_forward=i % 2 == 1)
        text = decode(tok, ids)
        assert ended, f"walk did not end: {text!r}"
        jsonschema.validate(json.loads(text), enforced)


def test_ebnf_random_walks(backend, tok, vocab_info):
    if "ebnf" not in backend.supported_kinds:
        pytest.skip(f"{backend.name} has no EBNF")
    compiled = backend.compile("ebnf", TUPLE_EBNF)
    rng = np.random.default_rng(2)
    for _ in range(NUM_WALKS):
        ids, ended = random_walk(backend, tok, vocab_info, compiled, rng)
        assert ended and re.fullmatch(TUPLE_REGEX, decode(tok, ids))


def test_outlines_drops_integer_bounds(tok):
    """Documented limitation: outlines-core ignores integer minimum/maximum; llguidance doesn't."""
    schema = json.dumps({"type": "object", "properties": {"age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]})
    ids = tok.encode('{"age":999}', add_special_tokens=False)
    for name, admits in [("outlines", True), ("llguidance", False)]:
        backend = _backends.get(name) or create_backend(name, tok, tok.vocab_size)
        matcher = backend.compile("json_schema", schema).new_matcher()
        accepted = all(matcher.accept_token(t) for t in ids)
        assert accepted == admits, name


# ---------------------------------------------------------------------------- mask contract


def test_mask_agrees_with_accept_token(backend, tok, vocab_info):
    """Bit set <=> accept_token succeeds; rollback restores the state."""
    matcher = compile_cached(backend, "json_schema", json.dumps(PERSON)).new_matcher()
    for t in tok.encode('{"name":"Al', add_special_tokens=False):
        assert matcher.accept_token(t)
    row = np.zeros(backend.num_mask_words, dtype=np.int32)
    matcher.fill_bitmask(row)
    allowed = set(allowed_token_ids(row).tolist())
    rng = np.random.default_rng(3)
    candidates = rng.choice(tok.vocab_size, 300, replace=False).tolist()
    candidates += sorted(allowed)[:50] + [tok.vocab_size, tok.vocab_size + 1]
    for t in candidates:
        ok = matcher.accept_token(t)
        assert ok == (t in allowed), t
        if ok:
            matcher.rollback(1)
    after = np.zeros_like(row)
    matcher.fill_bitmask(after)
    np.testing.assert_array_equal(after, row)
    assert not (set(np.flatnonzero(vocab_info["control"]).tolist()) & allowed), (
        "raw control characters allowed inside a JSON string")


def test_padding_words_zero(backend, tok):
    matcher = backend.compile("regex", r"(.|\n)*").new_matcher()
    row = np.full(backend.num_mask_words, -1, dtype=np.int32)
    matcher.fill_bitmask(row)
    allowed = allowed_token_ids(row)
    assert allowed.size > 40000 and allowed.max() < tok.vocab_size
    assert not row[tok.vocab_size // 32:].any()


def test_eos_and_termination(backend, tok):
    row = np.zeros(backend.num_mask_words, dtype=np.int32)
    eos = set(tok.eos_token_ids)
    done = backend.compile("regex", "(yes|no|maybe)").new_matcher()
    assert not done.is_terminated()
    for t in tok.encode("yes", add_special_tokens=False):
        assert done.accept_token(t)
    assert done.is_terminated()
    done.fill_bitmask(row)
    assert set(allowed_token_ids(row).tolist()) == eos
    assert done.forced_tokens() == []

    more = backend.compile("regex", "[0-9]+").new_matcher()
    more.fill_bitmask(row)
    assert not eos & set(allowed_token_ids(row).tolist())
    assert not more.accept_token(tok.eos_token_ids[0])
    assert more.accept_token(tok.encode("5", add_special_tokens=False)[0])
    assert not more.is_terminated()
    more.fill_bitmask(row)
    allowed = set(allowed_token_ids(row).tolist())
    assert eos <= allowed and len(allowed) > len(eos)
    assert more.accept_token(tok.eos_token_ids[0]) and more.is_terminated()
    more.fill_bitmask(row)
    assert set(allowed_token_ids(row).tolist()) == eos
    assert not more.accept_token(tok.encode("5", add_special_tokens=False)[0])
    more.rollback(1)  # un-accept EOS
    assert not more.is_terminated()
    assert more.accept_token(tok.encode("6", add_special_tokens=False)[0])


# ---------------------------------------------------------------------------- jump-forward


def test_forced_tokens_are_canonical(backend, tok):
    matcher = compile_cached(backend, "json_schema", json.dumps(NAME_AGE)).new_matcher()
    forced = matcher.forced_tokens()
    text = decode(tok, forced)
    assert forced and '{"name":"'.startswith(text), text
    assert forced == tok.encode(text, add_special_tokens=False)
    for t in forced:
        assert matcher.accept_token(t)
    # The rest of the text the grammar forces is tokenized the same way as a whole.
    full = tok.encode('{"name":"Bob","age":7}', add_special_tokens=False)
    assert full[: len(forced)] == forced


@pytest.mark.parametrize(("forced", "stable"), [
    ('{"name":"', '{"name'),
    ("hello world, ", "hello world,"),
    ("it'r", "it"),  # `'re` could follow: the quote is not stable yet
    ("a\n\n\n\n", "a"),
    ("12.5, x", "12.5,"),
    ("we'll, ok", "we'll,"),
    ("a 'b", "a"),
    ("x\n  ", "x"),
    ("abc", ""),
])
def test_canonical_forced_tokens(tok, forced, stable):
    tokens = canonical_forced_tokens(tok, forced.encode())
    assert decode(tok, tokens) == stable
    assert tokens == tok.encode(stable, add_special_tokens=False)


def test_canonical_forced_tokens_survive_any_continuation(tok):
    """Fuzz: the stable tokens of s are a prefix of the tokenizer's encoding of s + c."""
    alphabet = list("ab Z09'\n\t.,:\"{}-_é") + [" s", "re", "ll", "  ", "\n\n"]
    rng = np.random.default_rng(5)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, rng.integers(1, 10)))
        more = "".join(rng.choice(alphabet, rng.integers(1, 4)))
        stable = canonical_forced_tokens(tok, text.encode())
        whole = tok.encode(text + more, add_special_tokens=False)
        assert whole[: len(stable)] == stable, (text, more)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("kind", "text", "message", "names"), [
    ("regex", "(", "invalid regex", "'('"),
    ("regex", "(?=a)a", "unsupported grammar feature", "(?=a)a"),
    ("json_schema", '{"type": "nonsense"}', "invalid JSON schema", "nonsense"),
    ("json_schema", "{", "invalid JSON schema", "not valid JSON"),
    ("ebnf", "root ::= foo", "EBNF", "foo"),
    ("yaml", "a: b", "unknown grammar kind", "yaml"),
])
def test_grammar_errors(backend, kind, text, message, names):
    if kind == "ebnf" and "ebnf" not in backend.supported_kinds:
        message, names = "unsupported grammar feature", "does not support 'ebnf'"
    with pytest.raises(GrammarError, match=message) as exc:
        backend.compile(kind, text)
    assert names in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unknown_backend(tok):
    with pytest.raises(ValueError, match="llguidance, outlines, xgrammar"):
        create_backend("nope", tok, tok.vocab_size)
    with pytest.raises(ValueError, match="smaller"):
        create_backend("llguidance", tok, tok.vocab_size - 1)


# ---------------------------------------------------------------------------- GrammarManager


class _FakeBackend:
    """Records which thread compiles; `gate` holds compilation until set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def compile(self, kind: str, text: str) -> object:
        self.gate.wait(timeout=10)
        self.calls.append((kind, text, threading.current_thread().name))
        if text == "bad":
            raise GrammarError("invalid regex 'bad'")
        return object()


def test_grammar_manager_off_thread_and_cached():
    fake = _FakeBackend()
    manager = GrammarManager(fake, max_cached=2)
    try:
        fake.gate.clear()
        first = manager.request("regex", "a")
        assert not first.done()  # request does not wait for the compile
        assert manager.request("regex", "a") is first  # pending compiles are shared too
        fake.gate.set()
        compiled = first.result(timeout=10)
        again = manager.request("regex", "a")
        assert again.done() and again.result() is compiled
        assert len(fake.calls) == 1 and fake.calls[0][2].startswith("grammar-compile")

        bad = manager.request("regex", "bad")
        with pytest.raises(GrammarError):
            bad.result(timeout=10)
        assert manager.request("regex", "bad") is bad  # the failure is cached
        assert len(fake.calls) == 2

        manager.request("regex", "c").result(timeout=10)  # evicts "a" (LRU, 2 entries)
        assert len(manager) == 2
        assert manager.request("regex", "a") is not first
    finally:
        manager.shutdown()


def test_grammar_manager_real_backend(tok):
    backend = _backends.get("llguidance") or create_backend("llguidance", tok, tok.vocab_size)
    manager = GrammarManager(backend)
    try:
        future = manager.request("json_schema", json.dumps(PERSON))
        compiled = future.result(timeout=30)
        assert manager.request("json_schema", json.dumps(PERSON)).result() is compiled
        with pytest.raises(GrammarError, match="invalid regex"):
            manager.request("regex", "(").result(timeout=30)
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------- timing report


def test_timing_report(backend, tok):
    """Prints compile and per-token mask times (run with -s); asserts nothing about speed."""
    grammars = [("regex", REGEXES[0]), ("json_schema", json.dumps(PERSON))]
    if "ebnf" in backend.supported_kinds:
        grammars.append(("ebnf", TUPLE_EBNF))
    row = np.zeros(backend.num_mask_words, dtype=np.int32)
    for kind, text in grammars:
        start = time.perf_counter()
        compiled = backend.compile(kind, text)
        compile_ms = (time.perf_counter() - start) * 1e3
        matcher = compiled.new_matcher()
        rng = np.random.default_rng(4)
        mask_us = []
        for _ in range(WALK_MAX_STEPS):
            start = time.perf_counter()
            matcher.fill_bitmask(row)
            mask_us.append((time.perf_counter() - start) * 1e6)
            allowed = allowed_token_ids(row)
            token = int(rng.choice(allowed))
            if token in tok.eos_token_ids or not matcher.accept_token(token):
                break
        print(f"\n[timing] {backend.name:10s} {kind:11s} compile {compile_ms:8.2f} ms  "
              f"mask mean {np.mean(mask_us):7.1f} us  p99 {np.percentile(mask_us, 99):7.1f} us  "
              f"({len(mask_us)} tokens)")
