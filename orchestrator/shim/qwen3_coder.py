"""The qwen3_coder tool-call parser: Qwen3-Coder's XML-like calls, as its chat template
renders them back (several may follow each other, after some text):

    <tool_call>
    <function=NAME>
    <parameter=P>
    value, as written (any number of lines)
    </parameter>
    </function>
    </tool_call>

A value is raw text: the template writes `str(value)` (JSON for objects and arrays)
between a newline after `<parameter=P>` and one before `</parameter>`, so those two
newlines are dropped and the rest is typed by the parameter's JSON schema, as vLLM's
qwen3_coder parser does: a string stays the text; integer, number, boolean, null, object
and array are read as JSON (booleans in any case: the template writes Python's "True";
"null" is None unless the value can only be a string), and a value that does not read
as its type stays the text (vLLM tries Python literals too; arguments here are JSON
only). A parameter the schema does not name, or a tool the request does not have, keeps
its text.

A call must be whole to count: every parameter closed, then `</function>` (the closing
`</tool_call>` may be missing where the answer ended at EOS, as after a forced call's
grammar). Anything else between the tags (text between parameters, an unclosed value)
makes the call the model's text. A value cannot contain `</parameter>`, nor the call
`</tool_call>`: those end it, as in the model's own training format.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.shim.tagged_calls import TaggedCallParser, ToolCall, sendable

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# JSON schema type names of a parsed JSON value (a string value is never read as JSON)
_JSON_TYPES: dict[type, set[str]] = {bool: {"boolean"}, int: {"integer", "number"},
                                     float: {"number"}, type(None): {"null"},
                                     dict: {"object"}, list: {"array"}}


def properties(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters' schemas by name ({} where it declares none)."""
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows ({} where it does not say): "type"
    (one or a list), else its anyOf / oneOf branches', else its enum or const values'."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return set().union(*(schema_types(s) for s in schema[key]))
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    if isinstance(values, list):
        return set().union(*(_value_types(v) for v in values))
    return set()


def _value_types(value: Any) -> set[str]:
    return {"string"} if isinstance(value, str) else _JSON_TYPES.get(type(value), set())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")  # Python reads NaN; a response cannot hold it


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type (see the module docstring)."""
    types = schema_types(schema) - {"string"}
    if not types:
        return text
    word = text.strip().lower()
    if word in ("true", "false") and "boolean" in types:
        return word == "true"
    if word == "null":
        return None  # no value, whatever the type (as vLLM reads it)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return text
    return value if _value_types(value) & types else text


def _element_name(body: str, pos: int, prefix: str) -> tuple[str, int] | None:
    """The NAME of `<prefix NAME>` at `pos`, and where its content starts."""
    if not body.startswith(prefix, pos):
        return None
    end = body.find(">", pos)
    name = body[pos + len(prefix):end].strip() if end >= 0 else ""
    if not name or "<" in name or "\n" in name:
        return None
    return name, end + 1


def _skip_space(body: str, pos: int) -> int:
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos


def parse_functions(body: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The calls in one `<tool_call>` body (usually one `<function=...>`), or None where
    it is not wholly calls. `schemas`: each tool's parameters' schemas."""
    calls: list[ToolCall] = []
    pos = _skip_space(body, 0)
    while pos < len(body):
        head = _element_name(body, pos, FUNCTION)
        if head is None:
            return None
        name, pos = head
        props = schemas.get(name, {})
        args: dict[str, Any] = {}
        while not body.startswith(FUNCTION_END, pos := _skip_space(body, pos)):
            param = _element_name(body, pos, PARAMETER)
            if param is None:
                return None  # text between parameters, or the body ended inside the call
            key, start = param
            end = body.find(PARAMETER_END, start)
            if end < 0:
                return None
            text = body[start:end]
            text = text[1:] if text.startswith("\n") else text
            text = text[:-1] if text.endswith("\n") else text
            args[key] = typed_value(text, props.get(key))
            pos = end + len(PARAMETER_END)
        if not sendable(name, args):
            return None
        calls.append(ToolCall(name, args))
        pos = _skip_space(body, pos + len(FUNCTION_END))
    return calls or None


class Qwen3CoderParser(TaggedCallParser):
    call_format = "xml"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__()
        self._schemas = {t["function"]["name"]: properties(t["function"]) for t in tools}

    def opening(self, name: str | None) -> str | None:
        # as the template renders a call back: "<tool_call>\n<function=NAME>\n<parameter=..."
        head = self.OPEN + "\n" + FUNCTION
        return head if name is None else head + name + ">\n"

    def calls_in(self, body: str, *, closed: bool) -> list[ToolCall] | None:
        return parse_functions(body, self._schemas)
