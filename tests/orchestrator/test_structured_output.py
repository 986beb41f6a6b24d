"""The grammars structured outputs and forced tool calls send to the engine: they accept
what the tool parsers read back as calls (names needing escapes included), they refuse
other text, and a schema that cannot be followed is a 400 in each API's shape."""

from __future__ import annotations

import pytest

from orchestrator.shim.anthropic_request import parse_messages_request
from orchestrator.shim.errors import ApiError
from orchestrator.shim.openai_request import parse_chat_request
from orchestrator.shim.structured_output import after_reasoning, json_grammar, tool_call_grammar
from orchestrator.shim.tool_parsers import ToolCall, make_tool_parser
from scheduler.guided import GuideFactory

NAMES = ["Bash", 'Re"ad\\me', "Pflück"]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
    "additionalProperties": False}}} for n in NAMES]


def follows(guides: GuideFactory, grammar: str, tokenizer, text: str) -> bool:
    guide = guides.guide(grammar)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(guide.accept(t) for t in ids) and guide.complete


@pytest.mark.parametrize("answer, ok", [("{}", True), ("\n\n{}", True), ("\n\n\n{}", False),
                                        (" x{}", False)])
def test_after_reasoning_the_answer_may_start_with_whitespace(guides, tiny_tokenizer, answer,
                                                             ok) -> None:
    """A reasoning model's answer follows "</think>\n\n": the format holds after it."""
    grammar = after_reasoning(json_grammar({"type": "object"}, "response_format"))
    assert follows(guides, grammar, tiny_tokenizer, answer) == ok


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("name", [None, *NAMES])
def test_a_forced_call_grammar_accepts_exactly_a_call(guides, tiny_tokenizer, parser,
                                                      name) -> None:
    p = make_tool_parser(parser)
    grammar = tool_call_grammar(TOOLS, name, p.opening)
    for tool in [name] if name else NAMES:
        rest = p.opening(tool)[len(p.opening(name)):] + '{"n": 7}}'
        assert follows(guides, grammar, tiny_tokenizer, rest), rest
        reader = make_tool_parser(parser)
        events = reader.feed(p.opening(name) + rest) + reader.finish()
        assert events == [ToolCall(tool, {"n": 7})]
    opening = p.opening(name)
    wrong = p.opening("Other")[len(opening):] if name is None else '{"n":7}}'
    assert not follows(guides, grammar, tiny_tokenizer, wrong)


def test_json_grammar(guides, tiny_tokenizer) -> None:
    grammar = json_grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                           "response_format")
    assert follows(guides, grammar, tiny_tokenizer, "[1, 2]")
    assert not follows(guides, grammar, tiny_tokenizer, "[1, 2, 3]")
    # keywords the compiler lacks are ignored, not refused (agents' schemas use them)
    json_grammar({"type": "object", "propertyNames": {"pattern": "^a"}}, "x")
    for bad in ({"type": "objectx"}, [1], {"$ref": "#/nowhere"}):
        with pytest.raises(ApiError, match="response_format"):
            json_grammar(bad, "response_format")


HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
])
def test_openai_bad_response_format(extra, param) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": HELLO, **extra}, {})
    assert info.value.param == param and info.value.status == 400


def test_openai_response_formats() -> None:
    for fmt, guided in (({"type": "text"}, False), ({"type": "json_object"}, True),
                        ({"type": "json_schema", "json_schema": {"name": "x"}}, True)):
        req = parse_chat_request({"messages": HELLO, "response_format": fmt}, {})
        assert (req.grammar is not None) == guided


@pytest.mark.parametrize("extra, param", [
    ({"output_format": {"type": "xml"}}, "output_format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}},
     "output_config.format"),
])
def test_anthropic_bad_output_format(extra, param) -> None:
    with pytest.raises(ApiError) as info:
        parse_messages_request({"messages": HELLO, "max_tokens": 5, **extra}, {})
    assert info.value.param == param and info.value.status == 400


def test_anthropic_output_config_without_a_format_changes_nothing() -> None:
    req = parse_messages_request({"messages": HELLO, "max_tokens": 5,
                                  "output_config": {"effort": "high"}}, {})
    assert req.grammar is None
    req = parse_messages_request({"messages": HELLO, "max_tokens": 5, "output_format": {
        "type": "json_schema", "schema": {"type": "object"}}}, {})
    assert req.grammar is not None
