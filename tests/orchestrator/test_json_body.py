"""Request bodies: one JSON object in UTF-8, not too deep, with valid Unicode strings;
everything else a 400 that says why (cases the fuzzer found as 500s included)."""

from __future__ import annotations

import json

import pytest

from orchestrator.shim.errors import ApiError
from orchestrator.shim.json_body import MAX_DEPTH, loads, parse_json_object


def refused(raw: bytes) -> str:
    with pytest.raises(ApiError) as info:
        parse_json_object(raw)
    assert info.value.status == 400
    return info.value.message


def nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_valid_bodies() -> None:
    body = {"messages": [{"role": "user", "content": "h\u00e9llo \U0001f642 \\ud800"}],
            "n": 1.5}
    assert parse_json_object(json.dumps(body).encode()) == body
    assert parse_json_object(json.dumps(body, ensure_ascii=False).encode()) == body
    assert parse_json_object(nested(MAX_DEPTH)) is not None
    # A surrogate pair escaped the JSON way is one valid character.
    assert parse_json_object(b'{"t": "\\ud83d\\ude42"}') == {"t": "\U0001f642"}


@pytest.mark.parametrize("raw, why", [
    (b"", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"a": NaN', "not valid JSON"),
    (b'{"a": [NaN]}', "holds nan, which is not a JSON number"),  # json.loads reads them
    (b'{"a": -Infinity}', "holds -inf"),
    (b'{"a": 1e999}', "holds inf"),
    (b'{"t": "\xed\xa0\x80"}', "not valid UTF-8"),  # an encoded surrogate
    (b'{"t": "\xff"}', "not valid UTF-8"),
    ('{"t": "x"}'.encode("utf-16"), "not valid UTF-8"),
    (b'\xef\xbb\xbf{"t": 1}', "not valid JSON"),  # a BOM
    (b'{"t": "\\ud800"}', "lone UTF-16 surrogate (\\ud800)"),
    (b'{"\\udfff": 1}', "lone UTF-16 surrogate (\\udfff)"),
    (b'{"t": [{"u": "a\\udc00b"}]}', "lone UTF-16 surrogate"),
    (nested(MAX_DEPTH + 1), "nested more than"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than"),
])
def test_refused_bodies(raw: bytes, why: str) -> None:
    assert why in refused(raw)


def test_json_inside_a_string_is_held_to_the_same_rules() -> None:
    """OpenAI's tool-call arguments: a JSON string the shim parses (a RecursionError 500
    the fuzzer found)."""
    assert loads('{"city": "Paris"}', "arguments") == {"city": "Paris"}
    with pytest.raises(ValueError):
        loads("{not json", "arguments")
    for text, why in (("[" * 100_000 + "]" * 100_000, "arguments is nested more than"),
                      ("[" * 200 + "]" * 200, "arguments is nested more than"),
                      ('{"a": "\\udfff"}', "arguments holds a lone UTF-16 surrogate")):
        with pytest.raises(ApiError, match=why):
            loads(text, "arguments")


def test_a_long_list_of_ints_is_not_walked_but_anything_else_in_it_is() -> None:
    """A list of only ints (a prompt of token ids) skips the element-by-element walk; a
    NaN or a lone surrogate among thousands of ids is still found."""
    ids = list(range(5000))
    assert parse_json_object(json.dumps({"prompt": ids}).encode()) == {"prompt": ids}
    assert "not a JSON number" in refused(b'{"prompt": [' + b"1, " * 5000 + b"NaN]}")
    assert "surrogate" in refused(b'{"prompt": [' + b"1, " * 5000 + b'"\\ud800"]}')
