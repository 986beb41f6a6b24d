"""Tool calls in model output, parsed back from streamed text.

A parser is fed the detokenized text as it streams and returns events: text that is
safe to send, and complete tool calls. What it cannot yet classify (the start of a
tag, a JSON object still open) is held back. A call that does not parse becomes text,
never an error: the client sees exactly what the model wrote.

    hermes       Hermes / Qwen 2.5 / Qwen 3:
                 <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.1+: the whole answer is {"name": ..., "parameters": {...}}
                 (optionally after <|python_tag|>, several separated by ";")
    none         no tool calls: everything is text

Text right before a Hermes call loses its trailing whitespace: chat templates put their
own newline before `<tool_call>` when the conversation is rendered back, so the next
prompt reproduces the model's output exactly (the prefix cache keeps hitting).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.shim.errors import ApiError
from orchestrator.shim.json_body import check_value


@dataclass
class TextEvent:
    text: str


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Event = TextEvent | ToolCall


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...

    def opening(self, name: str | None) -> str | None:
        """The start of a call in this format, up to its arguments when `name` is given
        (else up to the name), or None where the format has no calls. Appended to the
        prompt, it makes the model's answer the rest of a call: how tool_choice forces
        one (as Anthropic's API does), without constraining the tokens themselves."""
        ...


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "none")


def make_tool_parser(name: str, tool_names: list[str] | None = None) -> ToolParser:
    """`tool_names`: the request's tools. A Llama 3 answer is a call only if it names one
    of them (it has no tag: an answer that is JSON with a "name" is not a call)."""
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser(tool_names)
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
    if not isinstance(args, dict):
        return None
    try:
        check_value([obj["name"], args], "a tool call")
    except ApiError:
        return None
    return ToolCall(obj["name"], args)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _json_opening(name: str | None, args_key: str) -> str:
    if name is None:
        return '{"name": "'
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": '


class PlainText:
    def feed(self, text: str) -> list[Event]:
        return [TextEvent(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def opening(self, name: str | None) -> str | None:
        return None


class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._inside = False
        self._buf = ""  # outside: held text (a partial tag, trailing whitespace); inside: the call
        self._num_calls = 0
        self._space = ""

    def opening(self, name: str | None) -> str | None:
        # as the Hermes / Qwen templates render a call back: "<tool_call>\n{...}\n</tool_call>"
        return self.OPEN + "\n" + _json_opening(name, "arguments")

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return events
                events.append(self._parse(self._buf[:end], closed=True))
                self._buf = self._buf[end + len(self.CLOSE):]
                self._inside = False
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                before = self._buf[:start].rstrip()
                if before:
                    events.append(TextEvent(before))
                self._space = self._buf[len(before):start]  # given back if the call is bad
                self._buf = self._buf[start + len(self.OPEN):]
                self._inside = True
                continue
            # Hold a possible partial tag, and trailing whitespace (dropped if a call follows).
            keep = partial_suffix(self._buf, self.OPEN)
            head, held = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            stripped = head.rstrip()
            if stripped:
                events.append(TextEvent(stripped))
            self._buf = head[len(stripped):] + held
            return events

    def finish(self) -> list[Event]:
        if self._inside:
            body, self._buf, self._inside = self._buf, "", False
            return [self._parse(body, closed=False)]
        rest, self._buf = self._buf, ""
        if self._num_calls and not rest.strip():
            return []  # whitespace after the last call: the template renders its own
        return [TextEvent(rest)] if rest else []

    def _parse(self, body: str, *, closed: bool) -> Event:
        try:
            call = _call_from_json(json.loads(body))
        except (ValueError, RecursionError):
            call = None
        if call is not None:
            self._num_calls += 1
            return call
        return TextEvent(self._space + self.OPEN + body + (self.CLOSE if closed else ""))


class Llama3JsonParser:
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
