"""Tool-call parsers on scripted model output: every way of cutting the stream into
chunks gives the same events, and a malformed call comes back as the model's text."""

from __future__ import annotations

import random

import pytest

from orchestrator.shim.tool_parsers import (
    Event,
    HermesParser,
    Llama3JsonParser,
    TextEvent,
    ToolCall,
    make_tool_parser,
)


def run(parser_name: str, chunks: list[str], tools: list[dict] | None = None) -> list[Event]:
    """Feed chunks; merge adjacent text events (chunking may split text anywhere)."""
    parser = make_tool_parser(parser_name, tools)
    events: list[Event] = []
    for c in chunks:
        events += parser.feed(c)
    events += parser.finish()
    merged: list[Event] = []
    for e in events:
        if isinstance(e, TextEvent) and merged and isinstance(merged[-1], TextEvent):
            merged[-1] = TextEvent(merged[-1].text + e.text)
        elif not (isinstance(e, TextEvent) and not e.text):
            merged.append(e)
    return merged


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """Whole, char by char, every two-way split, and random cuts."""
    rng = random.Random(seed)
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return ways


CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


@pytest.mark.parametrize("text, expected", [
    ("Just text, no calls.", [TextEvent("Just text, no calls.")]),
    (CALL, [ToolCall("Bash", {"command": "ls -la"})]),
    ("Let me look.\n" + CALL,
     [TextEvent("Let me look."), ToolCall("Bash", {"command": "ls -la"})]),
    (CALL + "\n" + CALL.replace("ls -la", "pwd") + "\n",
     [ToolCall("Bash", {"command": "ls -la"}), ToolCall("Bash", {"command": "pwd"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [ToolCall("f", {"a": 1})]),
    ('<tool_call>{"name": "f"}</tool_call>', [ToolCall("f", {})]),
    # unterminated but complete JSON: the model stopped at EOS before the closing tag
    ('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n',
     [ToolCall("f", {"x": [1, 2]})]),
    ("a <tool b <tools> c </tool_call>", [TextEvent("a <tool b <tools> c </tool_call>")]),
    ("trailing space stays  ", [TextEvent("trailing space stays  ")]),
])
def test_hermes(text: str, expected: list[Event]) -> None:
    for chunks in chunkings(text):
        assert run("hermes", chunks) == expected, chunks


@pytest.mark.parametrize("bad", [
    "<tool_call>{not json}</tool_call>",
    "Hi\n<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    "<tool_call>\n{\"name\": \"f\", \"argu",  # cut off by max_tokens
])
def test_hermes_malformed_call_is_the_models_text(bad: str) -> None:
    for chunks in chunkings(bad):
        assert run("hermes", chunks) == [TextEvent(bad)], chunks


def test_hermes_streams_text_before_the_call_completes() -> None:
    p = HermesParser()
    assert p.feed("Hello wor") == [TextEvent("Hello wor")]
    assert p.feed("ld <tool") == [TextEvent("ld")]  # " <tool" may start a call: held
    assert p.feed("_call>{\"name\": \"f\", ") == []
    assert p.feed('"arguments": {}}</tool_call>') == [ToolCall("f", {})]
    assert p.finish() == []


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [ToolCall("get_weather", {"city": "Paris"})]),
    ('  <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
     [ToolCall("a", {}), ToolCall("b", {"x": 1})]),
    ("The answer is 4.", [TextEvent("The answer is 4.")]),
    ('{"not": "a call"}', [TextEvent('{"not": "a call"}')]),
    ('{"name": "f", "parameters": {', [TextEvent('{"name": "f", "parameters": {')]),
])
def test_llama3_json(text: str, expected: list[Event]) -> None:
    for chunks in chunkings(text):
        assert run("llama3_json", chunks) == expected, chunks


def test_llama3_text_streams_at_once() -> None:
    p = Llama3JsonParser()
    assert p.feed("  ") == []
    assert p.feed("Sure") == [TextEvent("  Sure")]
    assert p.feed(", here.") == [TextEvent(", here.")]


def test_none_and_unknown() -> None:
    assert run("none", [CALL]) == [TextEvent(CALL)]
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_tool_parser("xml")


@pytest.mark.parametrize("parser, rest, expected", [
    ("hermes", '{"x": 1}}\n</tool_call>', [ToolCall("f", {"x": 1})]),
    ("hermes", "oops", [TextEvent('<tool_call>\n{"name": "f", "arguments": oops')]),
    ("llama3_json", '{"x": 1}}', [ToolCall("f", {"x": 1})]),
])
def test_a_forced_opening_is_read_as_the_start_of_the_call(parser, rest, expected) -> None:
    """tool_choice appends the opening to the prompt; the parser reads it before the
    model's answer, so the answer completes a call (or, if it does not, the client sees
    the whole text)."""
    p = make_tool_parser(parser)
    opening = p.opening("f")
    assert p.feed(opening) == []
    assert p.feed(rest) + p.finish() == expected
    any_tool = make_tool_parser(parser)
    assert any_tool.opening(None).endswith('{"name": "')
    assert any_tool.feed(any_tool.opening(None)) == []
    assert make_tool_parser("none").opening("f") is None


@pytest.mark.parametrize("parser, template", [
    ("hermes", '<tool_call>{"name": "f", "arguments": %s}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": %s}'),
])
@pytest.mark.parametrize("args", [
    '{"c": "echo \\ud83d"}',  # a lone surrogate: no response could carry it
    '{"c": "%s"}' % ("[" * 150 + "]" * 150),  # deep, as a string: fine
    '{"c": %s}' % ("[" * 150 + "]" * 150),  # past json_body's depth limit
    '{"c": %s}' % ("[" * 5000 + "]" * 5000),  # past Python's recursion limit
    '{"c": NaN}', '{"c": [-Infinity]}',  # Python reads them; JSON responses cannot hold them
])
def test_a_call_the_client_could_not_take_is_text(parser, template, args) -> None:
    """What a request body may not hold (orchestrator/shim/json_body.py) is not sent as a
    call either: it would be a 500 or a cut stream, and come back as a 400 next turn."""
    text = template % args
    events = run(parser, [text])
    if "[" * 150 in args and '"[' not in args or "\\ud83d" in args or "NaN" in args \
            or "Infinity" in args:
        assert events == [TextEvent(text)]
    else:
        assert [type(e) for e in events] == [ToolCall]


def test_llama3_json_calls_only_the_requests_tools() -> None:
    """Llama 3 calls have no tag: JSON naming no tool of the request is the answer."""
    for text, calls in (('{"name": "get_weather", "parameters": {}}', True),
                        ('{"name": "Bob", "parameters": {"age": 3}}', False)):
        p = make_tool_parser("llama3_json", [{"type": "function",
                                              "function": {"name": "get_weather"}}])
        events = p.feed(text) + p.finish()
        assert events == ([ToolCall("get_weather", {})] if calls else [TextEvent(text)])
