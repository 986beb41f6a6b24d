"""Structured outputs: the grammar a chat answer must follow, built from what the client
asked for and checked here, so a bad schema is a 400 before the engine sees it. The
scheduler holds the grammar's state and masks each sampled token (scheduler/guided.py).

    json_grammar(schema)           OpenAI response_format (json_object, json_schema),
                                   Anthropic output_format / output_config.format
    tool_call_grammar(tools, name) the rest of a call that tool_choice forces, after the
                                   tool parser's opening (orchestrator/shim/chat.py):
                                   JSON arguments, or Qwen3-Coder's XML parameters

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
from orchestrator.shim.qwen3_coder import PARAMETER, properties, schema_types

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
                      opening: Callable[[str | None], str], call_format: str = "json") -> str:
    """What follows a forced call's opening (`opening(name)`, the tool parser's): the
    named tool's arguments, or (no name) the rest of one tool's opening and its
    arguments; then what closes the call: the brace of the call object ("json"), or
    `</function>` ("xml", Qwen3-Coder's). (The parsers read a call closed so as a whole
    one, with or without an end tag: a tag such as </tool_call> may be a special token,
    which grammar text cannot produce.)"""
    functions = [t["function"] for t in tools
                 if name is None or t["function"]["name"] == name]
    if call_format == "xml":
        bodies, rules = _xml_arguments(functions)
        close = '"</function>"'
    else:
        bodies = [f"args{i}" for i in range(len(functions))]
        rules = [f"args{i}: %json {json.dumps(_styled(_parameters(f)))}"
                 for i, f in enumerate(functions)]
        close = '"}"'
    if name is not None:
        start = f"start: {bodies[0]} {close}"
    else:
        common = len(opening(None))  # every opening(tool) starts with it
        heads = [f"{json.dumps(opening(f['name'])[common:])} {bodies[i]}"
                 for i, f in enumerate(functions)]
        start = f'start: ({" | ".join(heads)}) {close}'
    return _checked(LLMatcher.grammar_from_lark("\n".join([start, *rules])), "tool_choice",
                    "the tools' input schemas")


# A string value, with the newline and `</parameter>` that end it: one terminal, so the
# lexer cannot end the value early; it holds neither closing tag (the parser would end
# the value, or the call, there). A string's minLength / maxLength are not held: a bounded
# repeat inside this intersection makes llguidance's lexer give up ("ParserTooComplex")
# from about 200 characters.
_XML_TEXT = (r'XML_TEXT: /(?s:.*)\n<\/parameter>/'
             r' & ~/(?s:.*(<\/parameter>|<\/tool_call>).*\n<\/parameter>)/')


def _xml_arguments(functions: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Per function, its parameters as Qwen3-Coder writes them, in the schema's order
    (the required ones always, the others optionally): "<parameter=P>\n" then the value
    (raw text for a string, else JSON that its schema accepts), "\n</parameter>\n".
    A tool that declares no parameters, and does not forbid them, may take any, as
    text. Returns (each function's body, the rules they use)."""
    bodies, rules = [], [_XML_TEXT]
    close = json.dumps("\n</parameter>\n")
    for i, function in enumerate(functions):
        props = properties(function)
        schema = _parameters(function)
        required = schema.get("required")
        # a parameter's schema may refer to the tool's definitions ("#/$defs/...")
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        parts = []
        for j, (key, prop) in enumerate(props.items()):
            head = json.dumps(f"{PARAMETER}{key}>\n")
            types = schema_types(prop)
            enum = prop.get("enum") if isinstance(prop, dict) else None
            if types and "string" not in types:
                rules.append(f"p{i}_{j}: {head} v{i}_{j} {close}")
                rules.append(f"v{i}_{j}: %json {json.dumps(_styled({**defs, **prop}))}")
            elif isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
                words = " | ".join(json.dumps(v) for v in enum)
                rules.append(f"p{i}_{j}: {head} ({words}) {close}")
            else:
                rules.append(f'p{i}_{j}: {head} XML_TEXT "\\n"')
            optional = not isinstance(required, list) or key not in required
            parts.append(f"p{i}_{j}" + ("?" if optional else ""))
        if not props and schema.get("additionalProperties") is not False:
            rules.append(f'p{i}_any: {json.dumps(PARAMETER)} /[^<>\\n]+/ ">\\n" XML_TEXT "\\n"')
            parts.append(f"p{i}_any*")
        bodies.append(" ".join(parts))
    return bodies, rules


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object"}
