"""Tool calls in model output, parsed back from streamed text.

A parser is fed the detokenized text as it streams and returns events: text that is
safe to send, and complete tool calls. What it cannot yet classify (the start of a
tag, a JSON object still open) is held back. A call that does not parse becomes text,
never an error: the client sees exactly what the model wrote.

    hermes       Hermes / Qwen 2.5 / Qwen 3:
                 <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    qwen3_coder  Qwen3-Coder: <tool_call><function=NAME><parameter=P>value</parameter>
                 </function></tool_call>, values typed by the tool's schema (qwen3_coder.py)
    llama3_json  Llama 3.1+: the whole answer is {"name": ..., "parameters": {...}}
                 (optionally after <|python_tag|>, several separated by ";")
    none         no tool calls: everything is text

The tagged formats (hermes, qwen3_coder) share one scanner (tagged_calls.py): text
before a call loses its trailing whitespace, as chat templates render it back.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from orchestrator.shim.qwen3_coder import Qwen3CoderParser
from orchestrator.shim.tagged_calls import (  # noqa: F401  (the events: re-exported)
    Event,
    TaggedCallParser,
    TextEvent,
    ToolCall,
    partial_suffix,
    sendable,
)


class ToolParser(Protocol):
    # What a forced call's grammar holds after `opening(name)` (structured_output.py):
    # "json" (the arguments object, then "}") or "xml" (Qwen3-Coder's parameters, then
    # "</function>"); "" where the format has no calls.
    call_format: str

    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...

    def opening(self, name: str | None) -> str | None:
        """The start of a call in this format, up to its arguments when `name` is given
        (else up to the name), or None where the format has no calls. Appended to the
        prompt, it makes the model's answer the rest of a call: how tool_choice forces
        one (as Anthropic's API does), without constraining the tokens themselves."""
        ...


TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "none")


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """`tools`: the request's tools (HF format). A Llama 3 answer is a call only if it
    names one of them (it has no tag: an answer that is JSON with a "name" is not a
    call); Qwen3-Coder's values are typed by their schemas."""
    if name == "hermes":
        return HermesParser()
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools or [])
    if name == "llama3_json":
        return Llama3JsonParser(None if tools is None else [t["function"]["name"] for t in tools])
    if name == "none":
        return PlainText()
    raise ValueError(f"unknown tool call parser {name!r} (choose from {TOOL_CALL_PARSERS})")


def _call_from_json(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object or JSON string of one}. A call
    the client could not be sent (a lone surrogate, NaN, nesting past json_body's limit)
    is no call: it stays the model's text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict) or not sendable(obj["name"], args):
        return None
    return ToolCall(obj["name"], args)


def _json_opening(name: str | None, args_key: str) -> str:
    if name is None:
        return '{"name": "'
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": '


class PlainText:
    call_format = ""

    def feed(self, text: str) -> list[Event]:
        return [TextEvent(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def opening(self, name: str | None) -> str | None:
        return None


class HermesParser(TaggedCallParser):
    call_format = "json"

    def opening(self, name: str | None) -> str | None:
        # as the Hermes / Qwen templates render a call back: "<tool_call>\n{...}\n</tool_call>"
        return self.OPEN + "\n" + _json_opening(name, "arguments")

    def calls_in(self, body: str, *, closed: bool) -> list[ToolCall] | None:
        # complete JSON counts without the closing tag: the model stopped at EOS
        try:
            call = _call_from_json(json.loads(body))
        except (ValueError, RecursionError):
            return None
        return None if call is None else [call]


class Llama3JsonParser:
    call_format = "json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: list[str] | None = None) -> None:
        self._mode: str | None = None  # None: undecided; "text" or "json"
        self._buf = ""
        self._names = None if tool_names is None else set(tool_names)

    def opening(self, name: str | None) -> str | None:
        return _json_opening(name, "parameters")

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [TextEvent(text)] if text else []
        self._buf += text
        if self._mode == "json":
            return []
        head = self._buf.lstrip()
        if not head or (len(head) < len(self.PYTHON_TAG) and self.PYTHON_TAG.startswith(head)):
            return []  # undecided yet
        if head.startswith("{") or head.startswith(self.PYTHON_TAG):
            self._mode = "json"  # a call (or a JSON answer): decided at the end
            return []
        self._mode = "text"
        out, self._buf = self._buf, ""
        return [TextEvent(out)]

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return [TextEvent(buf)] if buf else []
        calls = self._parse(buf)
        return calls if calls else [TextEvent(buf)]

    def _parse(self, buf: str) -> list[Event] | None:
        text = buf.strip()
        if text.startswith(self.PYTHON_TAG):
            text = text[len(self.PYTHON_TAG):]
        decoder = json.JSONDecoder()
        calls: list[Event] = []
        pos = 0
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return None
            call = _call_from_json(obj)
            if call is None or (self._names is not None and call.name not in self._names):
                return None
            calls.append(call)
