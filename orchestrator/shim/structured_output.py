"""Structured outputs: the grammar a chat answer must follow, built from what the client
asked for and checked here, so a bad schema is a 400 before the engine sees it. The
scheduler holds the grammar's state and masks each sampled token (scheduler/guided.py).

    json_grammar(schema)           OpenAI response_format (json_object, json_schema),
                                   Anthropic output_format / output_config.format
    tool_call_grammar(tools, name) the rest of a call that tool_choice forces, after the
                                   tool parser's opening (orchestrator/shim/chat.py)

JSON is written with json.dumps' separators (", " and ": ") and no other whitespace:
chat templates render a call's arguments back that way, so the next turn's prompt
repeats the model's own tokens and the prefix cache keeps hitting.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from llguidance import LLMatcher

from orchestrator.shim.errors import ApiError

# "lenient": keywords the compiler does not implement (propertyNames, ...) are ignored,
# not refused: tool schemas come from agents, not from us.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": True}


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_STYLE}


@functools.lru_cache(maxsize=64)
def _grammar_error(grammar: str) -> str:
    """llguidance's verdict on a grammar ("" if it compiles), kept: agents resend the same
    tools and formats every turn, and a large schema takes a tenth of a second."""
    return LLMatcher.validate_grammar(grammar)


def _checked(grammar: str, param: str, what: str) -> str:
    error = _grammar_error(grammar)
    if error:
        raise ApiError(f"{param}: {what} cannot be followed: {error.splitlines()[0]}",
                       param=param)
    return grammar


def json_grammar(schema: Any, param: str) -> str:
    """Any JSON value that `schema` (a JSON schema object) accepts."""
    if not isinstance(schema, dict):
        raise ApiError(f"{param}: the JSON schema must be an object", param=param)
    # as JSON text: llguidance raises (a 500) on a dict holding an int past 64 bits
    return _checked(LLMatcher.grammar_from_json_schema(json.dumps(_styled(schema))), param,
                    "the JSON schema")


def after_reasoning(grammar: str) -> str:
    """`grammar`, after the whitespace a reasoning model writes between its span and
    its answer ("</think>\n\n"): up to two whitespace characters may lead. (The span
    itself is the scheduler's: scheduler/thinking.py.)"""
    inner = json.loads(grammar)["grammars"]
    for i, part in enumerate(inner):
        part["name"] = f"answer{i}"
    lead = {"lark_grammar": r"start: /[ \t\r\n]{0,2}/ @answer0"}
    return _checked(json.dumps({"grammars": [lead, *inner]}), "response_format",
                    "the format after reasoning")


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None,
                      opening: Callable[[str | None], str]) -> str:
    """What follows a forced call's opening (`opening(name)`, the tool parser's): the
    named tool's arguments, or (no name) the rest of one tool's opening and its
    arguments; then the brace that closes the call object. (The parser reads a closed
    object as a whole call, with or without an end tag: a tag such as </tool_call> may
    be a special token, which grammar text cannot produce.)"""
    functions = [t["function"] for t in tools
                 if name is None or t["function"]["name"] == name]
    rules = [f"args{i}: %json {json.dumps(_styled(_parameters(f)))}"
             for i, f in enumerate(functions)]
    if name is not None:
        start = 'start: args0 "}"'
    else:
        common = len(opening(None))  # every opening(tool) starts with it
        heads = [f"{json.dumps(opening(f['name'])[common:])} args{i}"
                 for i, f in enumerate(functions)]
        start = f'start: ({" | ".join(heads)}) "}}"'
    return _checked(LLMatcher.grammar_from_lark("\n".join([start, *rules])), "tool_choice",
                    "the tools' input schemas")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object"}
