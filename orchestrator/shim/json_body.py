"""What a request body may be: one JSON object in UTF-8, nested at most MAX_DEPTH deep,
whose strings are valid Unicode. Anything else is a 400 here, so that no code after it
meets a value it cannot handle:

- nesting past Python's recursion limit makes json.loads, json.dumps and the chat
  template's tojson raise RecursionError wherever they meet it (a 500);
- a lone UTF-16 surrogate ("\\ud800", valid JSON) cannot be encoded to UTF-8: the
  tokenizer refuses it, and so does any response that echoes it back;
- invalid UTF-8 bytes (json.loads would decode them with "surrogatepass") likewise;
- NaN and Infinity (json.loads reads them, and 1e999 as infinity) are not JSON: a
  response that echoes one cannot be written (Starlette's JSON refuses it: a 500).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from orchestrator.shim.errors import ApiError

# Tool schemas nest a dozen levels at most; a hundred deep is no real request.
MAX_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or an ApiError (400) that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"the request body is not valid UTF-8: {exc}") from None
    try:
        body = loads(text, "the request body")
    except ValueError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def loads(text: str, what: str) -> Any:
    """json.loads held to the rules above (JSON inside a JSON string too: OpenAI's tool
    call arguments). ValueError if `text` is not JSON, ApiError if it breaks a rule."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ApiError(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    # Only \uD800-\uDFFF escapes can make surrogates once the text is valid UTF-8.
    _check_tree(value, what, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def check_value(value: Any, what: str) -> None:
    """The rules above for a value parsed elsewhere (a tool call the model wrote):
    ApiError if it breaks one."""
    _check_tree(value, what, strings=True)


# Values with nothing to check inside them (and no depth): a container of only these needs
# no visit of each element.
_NOTHING_INSIDE = {int, bool, type(None)}


def _check_tree(root: Any, what: str, *, strings: bool) -> None:
    """Depth (iteratively: the point is not to recurse) and, if asked, every string."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
            if strings:
                for key in value:
                    _check_string(key, what)
        elif isinstance(value, list):
            children = value
        else:
            if strings and isinstance(value, str):
                _check_string(value, what)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ApiError(f"{what} holds {value}, which is not a JSON number")
            continue
        if depth > MAX_DEPTH:
            raise ApiError(f"{what} is nested more than {MAX_DEPTH} levels deep")
        if set(map(type, children)) <= _NOTHING_INSIDE:
            continue  # a list of token ids, say: nothing in it to check, and thousands long
        stack.extend((child, depth + 1) for child in children)


def _check_string(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = s[exc.start]
        raise ApiError(f"{what} holds a lone UTF-16 surrogate (\\u{ord(bad):04x}), which is "
                       "not valid Unicode") from None
