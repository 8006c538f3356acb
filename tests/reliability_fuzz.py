"""Property-based fuzzing of every route's body with `hypothesis`: the server must answer each
generated body with a status below 500 (a 4xx naming the problem, or a normal answer).

Bodies start from a small valid body of the route and have one to three of its fields (or an
unknown one) replaced by a value of one *class* of bad input:

    typed      any JSON value (wrong types)          odd_unicode  lone surrogates, NUL, RTL, ...
    extreme    beyond-64-bit ints, huge floats, NaN  deep         nesting up to 5,000 levels
    huge_list  lists of up to 50,000 items           raw          non-JSON bytes, wrong types

so generated inputs reach the validation of every field, not only the JSON parser. What could
make a valid request expensive (token counts, `n`, batch width) is capped afterwards, so a run
is bounded in time. Seeded (`seed`) for reproducible CI runs; `seed=None` draws fresh examples.

Routes whose input is the URL (`URL_ROUTES`: a stored response's id in the path, paging
parameters in the query) get URLs instead: a known id, an unknown one or odd text as the id,
and up to three parameters with odd values, each percent-encoded from its UTF-8 bytes (lone
surrogates become invalid UTF-8).
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ROUTES: dict[str, dict[str, Any]] = {
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/responses": {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 4,
                      "temperature": 0},
    "/v1/messages": {"model": "default", "max_tokens": 4, "temperature": 0,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                     "tools": [{"name": "f", "input_schema": {
                         "type": "object", "properties": {"a": {"type": "string"}}}}]},
    "/v1/messages/count_tokens": {"model": "default", "system": "Be brief.",
                                  "messages": [{"role": "user", "content": "Hi"}]},
    "/abort_request": {"rid": "no-such-request"},
    "/flush_cache": {},
}
_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                  "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "seed",
                  "regex", "json_schema", "ebnf", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "no_stop_trim", "logit_bias", "custom_params",
                  "stream_interval")
_FIELDS: dict[str, tuple[str, ...]] = {
    "/generate": ("text", "input_ids", "sampling_params", "stream", "rid", "session_id",
                  "return_logprob", "logprob_start_len", "top_logprobs_num",
                  "return_text_in_logprobs", *(f"sampling_params.{k}" for k in _SAMPLING_KEYS)),
    "/v1/completions": ("prompt", "max_tokens", "n", "stream", "logprobs", "echo", "stop",
                        "seed", "logit_bias", "stop_token_ids", "min_tokens", "regex",
                        "json_schema", "stream_options", "temperature", "top_p", "model",
                        "session_id", "rid", "skip_special_tokens", "ignore_eos",
                        "prompt_cache_key", "user", "safety_identifier", "priority",
                        "program_id"),
    "/v1/chat/completions": ("messages", "max_tokens", "max_completion_tokens", "n", "stream",
                             "logprobs", "top_logprobs", "response_format", "tools",
                             "tool_choice", "stop", "seed", "logit_bias", "stop_token_ids",
                             "min_tokens", "chat_template_kwargs", "messages.0.content",
                             "messages.0.role", "temperature", "model", "session_id",
                             "prompt_cache_key", "user", "safety_identifier", "priority",
                             "retention_seconds", "program_id", "session_params"),
    "/v1/responses": ("input", "input.0", "input.0.content", "input.0.role", "instructions",
                      "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
                      "max_output_tokens", "temperature", "top_p", "text", "text.format",
                      "store", "stream", "metadata", "user", "seed", "top_k", "ignore_eos",
                      "model", "include", "include.0", "top_logprobs", "reasoning",
                      "reasoning.effort", "truncation", "prompt_cache_key",
                      "safety_identifier", "priority", "regex", "ebnf"),
    "/v1/messages": ("model", "messages", "messages.0", "messages.0.role", "messages.0.content",
                     "messages.0.content.0", "messages.0.content.0.type", "system",
                     "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                     "tools", "tools.0", "tools.0.input_schema", "tools.0.name", "tool_choice",
                     "thinking", "metadata", "metadata.user_id", "cache_control", "priority",
                     "messages.0.content.0.cache_control",
                     "messages.0.content.0.cache_control.ttl"),
    "/v1/messages/count_tokens": ("model", "messages", "messages.0", "messages.0.content",
                                  "messages.0.role", "system", "tools", "tool_choice",
                                  "thinking"),
    "/abort_request": ("rid",),
    "/flush_cache": ("x",),
}
# (method, path with "{id}", query parameters) of the routes whose input is the URL.
URL_ROUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("GET", "/v1/responses/{id}/input_items", ("after", "limit", "order", "include")),
    ("GET", "/v1/responses/{id}", ("include", "stream")),
    ("DELETE", "/v1/responses/{id}", ()),
)
# Caps applied to every generated body so valid ones stay cheap to serve.
_MAX_TOKENS_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens",
                    "min_tokens", "max_output_tokens")
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_N = 2
MAX_FUZZ_PROMPTS = 8

_ODD_STRINGS = ["\ud800", "a\udc00b", "\udfff\ud800", "\x00", "\u202e\u202d", "\ufeff",
                "\ufffd" * 3, "🙂" * 50, "e\u0301" * 20, "\U0010ffff", "\\", "\"", "<|im_end|>",
                "<|im_start|>user\n", "", " " * 1000, "x" * 5000]
_EXTREME_NUMBERS = [2**63, 2**63 - 1, 2**64, 2**64 - 1, -(2**63) - 1, 2**70, 10**30, -(10**30),
                    -1, 0, 2**31, 2**53 + 1, 1e308, -1e308, 5e-324, math.nan, math.inf,
                    -math.inf, 0.5, -0.0, 1e20]


def _json_values() -> st.SearchStrategy[Any]:
    leaves = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
              | st.text(max_size=20) | st.sampled_from(_ODD_STRINGS))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                        max_leaves=12)


def _nested(depth: int, as_dict: bool) -> str:
    """A placeholder that `_dumps` replaces by the nested JSON text (json.dumps itself would
    recurse too deep)."""
    return f"\x00deep:{depth}:{int(as_dict)}\x00"


_DEEP = re.compile(r'"\\u0000deep:(\d+):(\d)\\u0000"')


def _deep_text(match: re.Match) -> str:
    depth, as_dict = int(match.group(1)), match.group(2) == "1"
    return ('{"a":' * depth + "1" + "}" * depth) if as_dict else ("[" * depth + "1" + "]" * depth)


def _class_values(kind: str) -> st.SearchStrategy[Any]:
    if kind == "typed":
        return _json_values()
    if kind == "extreme":
        one = st.sampled_from(_EXTREME_NUMBERS) | st.integers(min_value=-(2**80),
                                                               max_value=2**80)
        return one | st.lists(one, min_size=1, max_size=4) | st.dictionaries(
            st.sampled_from(["1", "5", "-1", "99999999"]), one, max_size=2)
    if kind == "odd_unicode":
        odd = st.sampled_from(_ODD_STRINGS) | st.text(
            st.characters(codec=None, categories=["Cs", "Cc", "Cf", "Mn", "So", "Lo"]),
            max_size=30)
        return odd | st.lists(odd, min_size=1, max_size=3) | st.dictionaries(odd, odd,
                                                                              max_size=2)
    if kind == "deep":
        return st.builds(_nested, st.integers(1, 5000), st.booleans())
    if kind == "huge_list":
        item = st.sampled_from([1, 0, 17, "a", None, 1.5, {"a": 1}])
        return st.builds(lambda n, x: [x] * n, st.integers(1_000, 50_000), item)
    raise ValueError(f"unknown input class {kind!r}")


CLASSES = ("typed", "extreme", "odd_unicode", "deep", "huge_list", "raw")
_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "",
                  "application/json", "application/json; charset=utf-8", "application/xml"]


def _set_path(body: dict[str, Any], path: str, value: Any) -> None:
    """body[a][b]... = value for path "a.b..." (list indices as numbers); a path through a
    value that is neither an object nor a list (an earlier replacement) is skipped."""
    keys = path.split(".")
    node: Any = body
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or not node:
                return
            index = int(key) % len(node)
            if last:
                node[index] = value
                return
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[key] = value
                return
            if not isinstance(node.get(key), dict | list):
                node[key] = {}
            node = node[key]
        else:
            return


def _cap(body: Any) -> Any:
    """Keep valid bodies cheap: token counts, n and batch widths capped (recursively)."""
    if isinstance(body, dict):
        for key, value in list(body.items()):
            if key in _MAX_TOKENS_KEYS and isinstance(value, int) and not isinstance(value, bool) \
                    and value > MAX_FUZZ_TOKENS:
                body[key] = MAX_FUZZ_TOKENS
            elif key == "n" and isinstance(value, int) and not isinstance(value, bool) \
                    and value > MAX_FUZZ_N:
                body[key] = MAX_FUZZ_N
            elif key in ("text", "prompt", "input_ids") and isinstance(value, list) \
                    and value and isinstance(value[0], str | list) \
                    and len(value) > MAX_FUZZ_PROMPTS:
                body[key] = value[:MAX_FUZZ_PROMPTS]
            else:
                _cap(value)
    elif isinstance(body, list):
        for item in body[:64]:
            _cap(item)
    return body


def _default_lengths(body: dict[str, Any]) -> dict[str, Any]:
    """A request body without an output length gets the cap as one (its route's field: the
    sampling params', chat's or the Responses API's); only the top level is a request."""
    sp = body.get("sampling_params")
    for params in (sp if isinstance(sp, list) else [sp]):
        if isinstance(params, dict) and params.get("max_new_tokens") is None:
            params["max_new_tokens"] = MAX_FUZZ_TOKENS
    if "messages" in body and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    if "input" in body and body.get("max_output_tokens") is None:  # the Responses API
        body["max_output_tokens"] = MAX_FUZZ_TOKENS
    return body


def body_strategy(route: str, kind: str) -> st.SearchStrategy[tuple[bytes, str]]:
    """(raw body, content type) for `route` with fields of input class `kind`."""
    if kind == "raw":
        valid = json.dumps(ROUTES[route]).encode()
        raw = (st.binary(max_size=200)
               | st.integers(0, len(valid)).map(lambda n: valid[:n])
               | st.just(valid))
        return st.tuples(raw, st.sampled_from(_CONTENT_TYPES))
    fields = _FIELDS[route] + ("unknown_field",)

    def build(paths: list[str], values: list[Any]) -> tuple[bytes, str]:
        body = json.loads(json.dumps(ROUTES[route]))
        for path, value in zip(paths, values, strict=False):
            _set_path(body, path, value)
        return _dumps(_default_lengths(_cap(body))), "application/json"

    return st.builds(build, st.lists(st.sampled_from(fields), min_size=1, max_size=3),
                     st.lists(_class_values(kind), min_size=3, max_size=3))


def _dumps(body: Any) -> bytes:
    try:
        # ensure_ascii: lone surrogates go as \ud800 escapes, as a buggy client would send them
        return _DEEP.sub(_deep_text, json.dumps(body)).encode()
    except (ValueError, RecursionError):
        return b"{}"


def _quoted(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


def url_strategy(path: str, params: tuple[str, ...], ids: list[str]
                 ) -> st.SearchStrategy[str]:
    """URLs of `path` ("{id}" replaced) with odd ids and query values (`ids`: known ones)."""
    odd = (st.sampled_from(_ODD_STRINGS) | st.text(max_size=30)
           | st.integers(-(2**70), 2**70).map(str)
           | st.sampled_from(["0", "-1", "101", "20", "asc", "desc", "1e3", " 5", "true"]))
    if ids:
        odd = odd | st.sampled_from(ids)
    query = st.dictionaries(st.sampled_from(params + ("unknown",)), odd, max_size=3)

    def build(rid: str, q: dict[str, str]) -> str:
        url = path.replace("{id}", _quoted(rid))
        return url + ("?" + "&".join(f"{_quoted(k)}={_quoted(v)}" for k, v in q.items())
                      if q else "")

    return st.builds(build, odd, query)


def run_url_fuzz(send: Callable[[str, str], int], method: str, path: str,
                 params: tuple[str, ...], ids: list[str], num_examples: int,
                 seed: int | None) -> Counter:
    """`send(method, url)` for `num_examples` generated URLs of one `URL_ROUTES` entry; a
    Counter of status classes. Fails (AssertionError, with the URL) on a status >= 500."""
    def check(url: str) -> tuple[int, str]:
        return send(method, url), f"{method} {url[:300]}"

    return _run_property(url_strategy(path, params, ids), check, num_examples, seed)


def run_fuzz(send: Callable[[str, bytes, str], int], route: str, kind: str, num_examples: int,
             seed: int | None) -> Counter:
    """Send `num_examples` generated bodies; returns a Counter of status classes ("2xx", ...).
    Fails (AssertionError, with the body) on the first status >= 500."""
    def check(case: tuple[bytes, str]) -> tuple[int, str]:
        data, content_type = case
        return send(route, data, content_type), f"{route} to {data[:300]!r} ({content_type})"

    return _run_property(body_strategy(route, kind), check, num_examples, seed)


def _run_property(strategy, check: Callable[[Any], tuple[int, str]], num_examples: int,
                  seed: int | None) -> Counter:
    """Run `check` (its status and what it sent) on `num_examples` draws of `strategy`;
    count status classes, fail on the first status >= 500."""
    statuses: Counter = Counter()

    @settings(max_examples=num_examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case) -> None:
        status, sent = check(case)
        statuses[f"{status // 100}xx"] += 1
        assert status < 500, f"{sent} answered {status}"

    if seed is not None:
        prop = hypothesis_seed(seed)(prop)
    prop()
    return statuses
