"""What the tool-call parsers produce, and the scanner of the formats that wrap each call
in a pair of tags (Hermes' JSON, Qwen3-Coder's XML: both `<tool_call>...</tool_call>`).

The scanner streams text outside calls as soon as it cannot be the start of the opening
tag, holds a call until its closing tag (or the end of the answer), and hands its body to
the format's `calls_in`; a body that is no call goes out as the model's text, tags and all.

Text right before a call loses its trailing whitespace: chat templates put their own
newline before `<tool_call>` when the conversation is rendered back, so the next prompt
reproduces the model's output exactly (the prefix cache keeps hitting). Whitespace between
and after calls is dropped for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def sendable(name: str, arguments: dict[str, Any]) -> bool:
    """A call the client could be sent: no lone surrogate, NaN, or nesting past
    json_body's limit (it would be a 500 or a cut stream, and a 400 next turn)."""
    try:
        check_value([name, arguments], "a tool call")
    except ApiError:
        return False
    return True


class TaggedCallParser:
    """Calls between OPEN and CLOSE; a subclass reads a call's body (`calls_in`)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._inside = False
        self._buf = ""  # outside: held text (a partial tag, trailing whitespace); inside: the call
        self._num_calls = 0
        self._space = ""

    def calls_in(self, body: str, *, closed: bool) -> list[ToolCall] | None:
        """The calls one tagged body holds, or None where it is not a call. `closed`:
        False when the answer ended before the closing tag."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return events
                events += self._parse(self._buf[:end], closed=True)
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
            return self._parse(body, closed=False)
        rest, self._buf = self._buf, ""
        if self._num_calls and not rest.strip():
            return []  # whitespace after the last call: the template renders its own
        return [TextEvent(rest)] if rest else []

    def _parse(self, body: str, *, closed: bool) -> list[Event]:
        calls = self.calls_in(body, closed=closed)
        if calls:
            self._num_calls += len(calls)
            return list(calls)
        return [TextEvent(self._space + self.OPEN + body + (self.CLOSE if closed else ""))]
