"""Chat rendering: HF-compatible templates, and normalisation that keeps the prefix
stable from one request to the next (billing header, cache_control, string vs blocks,
the model's own tool calls rendered back exactly as it wrote them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.shim.anthropic_request import parse_messages_request
from orchestrator.shim.chat_template import ChatTemplate, strip_billing_header
from orchestrator.shim.errors import ApiError
from orchestrator.shim.tool_parsers import HermesParser, ToolCall
from tests.orchestrator.claude_code_body import claude_code_request


def render(template: ChatTemplate, body: dict, headers: dict | None = None) -> str:
    req = parse_messages_request({"max_tokens": 10, **body}, headers or {})
    return template.render(req.messages, req.tools)


def test_billing_header_is_dropped(tiny_template: ChatTemplate) -> None:
    a = render(tiny_template, claude_code_request("11111111-a")[0])
    b = render(tiny_template, claude_code_request("22222222-b")[0])
    assert a == b
    assert "billing" not in a and "cc_version" not in a
    assert "You are a Claude agent" in a
    assert strip_billing_header(["x-anthropic-billing-header: cc_version=1; x;\nkeep"]) == [
        "keep"]
    assert strip_billing_header(["hello", "x-anthropic-billing-header: later"]) == [
        "hello", "x-anthropic-billing-header: later"]  # only the first block is the header


def test_cache_control_and_string_vs_blocks_render_the_same(tiny_template) -> None:
    one = {"system": "Be brief.", "messages": [
        {"role": "user", "content": "hi", },
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "more",
                                      "cache_control": {"type": "ephemeral"}}]},
    ]}
    two = {"system": [{"type": "text", "text": "Be brief.",
                       "cache_control": {"type": "ephemeral"}}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": "more"},
    ]}
    assert render(tiny_template, one) == render(tiny_template, two)


def test_system_turn_inside_messages(tiny_template: ChatTemplate) -> None:
    text = render(tiny_template, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: general"}]}]})
    assert "<|im_start|>system\nAgents: general<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_are_rendered_through_the_template(tiny_template: ChatTemplate) -> None:
    body, _ = claude_code_request("s")
    text = render(tiny_template, body)
    assert "# Tools" in text and "<tools>" in text
    first = json.loads(text.split("<tools>\n")[1].split("\n")[0])
    assert first == {"type": "function", "function": {
        "name": "Agent", "description": body["tools"][0]["description"],
        "parameters": body["tools"][0]["input_schema"]}}


def test_the_models_tool_call_renders_back_as_it_wrote_it(tiny_template) -> None:
    """Model output -> parsed tool_use -> next request: the new prompt starts with the
    old prompt plus the model's exact text (so the prefix cache keeps hitting)."""
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    first = {"tools": tools, "messages": [{"role": "user", "content": "list files"}]}
    prompt = render(tiny_template, first)
    output = 'Let me look.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}' \
             '\n</tool_call>'
    parser = HermesParser()
    events = parser.feed(output) + parser.finish()
    assert events[1] == ToolCall("Bash", {"command": "ls"})
    second = {"tools": tools, "messages": [
        *first["messages"],
        {"role": "assistant", "content": [
            {"type": "text", "text": events[0].text},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"}]},
    ]}
    again = render(tiny_template, second)
    assert again.startswith(prompt + output + "<|im_end|>\n")
    assert "<tool_response>\na.py\nb.py\n</tool_response>" in again


def test_assistant_prefill_is_continued(tiny_template: ChatTemplate) -> None:
    text = render(tiny_template, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]})
    assert text.endswith("<|im_start|>assistant\nSure, ")


def test_template_refusing_late_system_gets_a_user_turn() -> None:
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    assert strict.render(msgs) == "[user]a[user]b"
    always = ChatTemplate("{{ raise_exception('no') }}")
    with pytest.raises(ApiError, match="refused"):
        always.render([{"role": "user", "content": "a"}])
    # a value of a type the template did not expect: the client's to fix (400), not a 500
    concat = ChatTemplate("{% for t in tools %}{{ 'tool: ' + t.description }}{% endfor %}")
    with pytest.raises(ApiError, match="refused"):
        concat.render([{"role": "user", "content": "a"}], [{"description": ["a list"]}])


def test_hf_environment(tmp_path: Path) -> None:
    """tojson keeps key order and does not escape HTML; special tokens are variables;
    named template lists and chat_template.jinja files are read."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages | tojson }}"},
            {"name": "tool_use", "template": "T{{ tools | tojson }}{{ eos_token }}"}]}))
    t = ChatTemplate.from_model_dir(tmp_path)
    assert t is not None
    msgs = [{"role": "user", "content": "<b>&", "z": 1, "a": 2}]
    assert t.render(msgs) == '<s>[{"role": "user", "content": "<b>&", "z": 1, "a": 2}]'
    assert t.render(msgs, [{"b": 1, "a": 2}]) == 'T[{"b": 1, "a": 2}]</s>'
    other = tmp_path / "other"
    other.mkdir()
    assert ChatTemplate.from_model_dir(other) is None
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                               "{% endfor %}")
    assert ChatTemplate.from_model_dir(other).render([{"role": "user", "content": "x"}]) == "x"
