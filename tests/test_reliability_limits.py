"""The pure checks behind the reliability guarantees: body parsing limits, the JSON-schema
recursion check, and the value checks of SamplingParams and batch sizes (no server)."""

from __future__ import annotations

import json

import pytest

from sgl_tpu.constrained.base import GrammarError, parse_json_schema
from sgl_tpu.constrained.schema_check import check_schema_is_finite
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.server.body_limits import (
    MAX_JSON_DEPTH,
    BodyError,
    is_json_content_type,
    parse_json,
    printable,
)
from sgl_tpu.validation import MAX_BATCH_ITEMS, check_batch_size, check_token_ids


@pytest.mark.parametrize("raw, words", [
    (b"[" * 5000 + b"]" * 5000, "nested"),
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
    (b'{"a": "\\ud800"}', "a: string is not valid Unicode"),
    (b'{"\\udfff": 1}', "Unicode"),
    (b'{"a": [1, {"b": 18446744073709551616}]}', "a[1].b: integer out of the 64-bit range"),
    (b'{"a": -9223372036854775809}', "64-bit"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_parse_json_refuses(raw, words):
    with pytest.raises(BodyError) as info:
        parse_json(raw)
    assert words in str(info.value) and info.value.status_code == 400


def test_parse_json_accepts_the_edges():
    depth = MAX_JSON_DEPTH - 1
    assert parse_json(b"[" * depth + b"]" * depth) is not None
    value = parse_json(b'{"a": 18446744073709551615, "b": -9223372036854775808, "c": "\\ud83d'
                       b'\\ude00"}')
    assert value == {"a": 2**64 - 1, "b": -(2**63), "c": "\U0001f600"}


def test_printable_escapes_surrogates():
    assert printable("a\ud800b") == "a\\ud800b"
    assert printable("plain é") == "plain é"


@pytest.mark.parametrize("value, ok", [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON", True), ("application/vnd.api+json", True), ("text/plain", False),
    ("", False), ("multipart/form-data; boundary=x", False), ("application/jsonx", False),
])
def test_json_content_type(value, ok):
    assert is_json_content_type(value) is ok


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"allOf": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
])
def test_schemas_without_a_base_case_are_refused(schema):
    with pytest.raises(GrammarError, match="recurses without a base case"):
        check_schema_is_finite(schema)
    with pytest.raises(GrammarError):
        parse_json_schema(json.dumps(schema))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # `a` optional
    {"type": "object", "properties": {"v": {"type": "integer"},
                                      "kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["v", "kids"]},  # an empty array ends it
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
    {"$ref": "https://example.com/schema"},  # remote: left to the backend
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}},
    True,
])
def test_finite_schemas_pass(schema):
    check_schema_is_finite(schema)


@pytest.mark.parametrize("params, words", [
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be a boolean"),
    ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
    ({"no_stop_trim": None, "regex": 5}, "regex must be a string"),
    ({"min_new_tokens": 2**64}, "min_new_tokens"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop": ["x"] * 257}, "at most 256 stop strings"),
    ({"stop": ["x" * 5000]}, "at most 4096 characters"),
    ({"temperature": "x" * 1000}, "temperature must be a number"),
])
def test_sampling_params_refuse(params, words):
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict(params)
    assert words in str(info.value) and len(str(info.value)) < 200


def test_batch_and_token_id_bounds():
    assert check_batch_size(MAX_BATCH_ITEMS) is None
    assert "at most" in check_batch_size(MAX_BATCH_ITEMS // 2 + 1, 2)
    assert check_token_ids("stop_token_ids", [0, 99], 100) is None
    for bad in ([100], [-1], [True], ["1"], 5):
        assert "stop_token_ids" in check_token_ids("stop_token_ids", bad, 100)
