"""The field checks both APIs' request modules share. Each API words its errors its own
way (Anthropic's as its server does, OpenAI's as OpenAI does), so a check takes its
message; what is checked, and how, is written here once."""

from __future__ import annotations

import json
import sys
from typing import Any

from orchestrator.shim.errors import ApiError

# The integers the engine's wire format (msgpack) carries signed: a larger seed or top_k
# would fail to encode after validation, as a 500.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_finite_number(v: Any) -> bool:
    """A JSON number a float can hold: not `true`, not NaN or infinite, not an integer
    past a float's range (float() would raise OverflowError)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= sys.float_info.max


def is_int64(v: Any) -> bool:
    """A JSON integer the engine's wire format can carry (msgpack: 64 bits); JSON `true`
    is not 1."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX


def all_int64(values: list[Any]) -> bool:
    """is_int64 of every element, the usual case (a prompt of token ids: thousands of
    plain ints) checked by type and range in C, not element by element in Python."""
    if set(map(type, values)) <= {int}:
        return not values or (INT64_MIN <= min(values) and max(values) <= INT64_MAX)
    return all(is_int64(v) for v in values)  # bools, int subclasses: one by one


def is_positive_int64(v: Any) -> bool:
    """A count (max_tokens, a thinking budget): an integer the wire carries, 1 at least."""
    return is_int64(v) and v >= 1


def describe(value: Any) -> str:
    """A short JSON rendering of a bad value, for error messages."""
    return json.dumps(value)[:40]


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 invalid_request_error about the field `param`."""
    return ApiError(message, param=param)


def number(body: dict[str, Any], name: str, default: float, message: str) -> float:
    """body[name] if it is a finite JSON number (as given: an integer stays one, for the
    caller's messages), `default` if absent or null; else a 400 with `message`, whose
    {name} and {value} are filled in."""
    v = body.get(name)
    if v is None:
        return default
    if not is_finite_number(v):
        raise invalid(message.format(name=name, value=describe(v)), name)
    return v


MAX_CACHE_SALT_CHARS = 256  # a tenant id or a digest fits; a salt is not a place for data


def cache_salt(body: dict[str, Any], message: str) -> str | None:
    """body["cache_salt"] (vLLM's field; an extension of Anthropic's body): a non-empty
    string of at most MAX_CACHE_SALT_CHARS characters, None if absent or null; else a 400
    with `message`, whose {limit} and {value} are filled in. Requests with different
    salts never share a cached block (it enters the hash of block 0)."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_CACHE_SALT_CHARS:
        raise invalid(message.format(limit=MAX_CACHE_SALT_CHARS, value=describe(v)),
                      "cache_salt")
    return v
