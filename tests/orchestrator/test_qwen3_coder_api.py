"""--tool-call-parser qwen3_coder through the shim, on scripted engine outputs shaped as
Qwen3-Coder writes them: Anthropic tool_use and OpenAI tool_calls, streamed and not,
typed by the tools' schemas; a forced call's prompt ends with the XML opening and the
grammar sent to the engine accepts the answer; a call rendered back by a template that
writes calls as Qwen3-Coder's does reproduces the model's text (the prefix holds)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.options import ShimOptions
from orchestrator.shim.server import parse_args
from scheduler.guided import GuideFactory
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_anthropic_api import make_client, sse_events

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"},
                                           "timeout": {"type": "integer"}},
          "required": ["command"]}
ANTHROPIC_TOOLS = [{"name": "Bash", "input_schema": SCHEMA},
                   {"name": "Read", "input_schema": {"type": "object", "properties": {
                       "path": {"type": "string"}}, "required": ["path"]}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"],
                                                  "parameters": t["input_schema"]}}
                for t in ANTHROPIC_TOOLS]
CALL = ("<tool_call>\n<function=Bash>\n<parameter=command>\nfind . -name '*.py' |\n  wc -l\n"
        "</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>")
ARGS = {"command": "find . -name '*.py' |\n  wc -l", "timeout": 30}
HELLO = [{"role": "user", "content": "count the files"}]


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=4096)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    with make_client(engine, tiny_tokenizer, tiny_template,
                     tool_call_parser="qwen3_coder") as c:
        yield c


@pytest.fixture
def claude(client) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client,
                               max_retries=0)


@pytest.fixture
def gpt(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                         max_retries=0)


def test_the_option_is_checked() -> None:
    args = parse_args(["--run-dir", "/r", "--model", "/m", "--tool-call-parser", "qwen3_coder"])
    assert ShimOptions.from_args(args).tool_call_parser == "qwen3_coder"
    with pytest.raises(ValueError, match="unknown --tool-call-parser"):
        ShimOptions(tool_call_parser="qwen3")
    with pytest.raises(SystemExit):
        parse_args(["--run-dir", "/r", "--model", "/m", "--tool-call-parser", "qwen3"])


def test_anthropic(claude, client, engine) -> None:
    engine.script("Let me count them.\n\n" + CALL)
    m = claude.messages.create(model="m", max_tokens=200, messages=HELLO, tools=ANTHROPIC_TOOLS)
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Let me count them."
    assert (m.content[1].name, m.content[1].input) == ("Bash", ARGS)

    engine.script("Let me count them.\n\n" + CALL)
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 200, "messages": HELLO,
                                          "tools": ANTHROPIC_TOOLS, "stream": True})
    events = sse_events(r.text)
    blocks = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    assert blocks == ["text", "tool_use"]
    partial = "".join(d["delta"]["partial_json"] for k, d in events
                      if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == ARGS
    assert [d for k, d in events if k == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_openai(gpt, engine) -> None:
    second = CALL.replace("30", "oops")  # not an integer: stays the text it was
    engine.script("Counting.\n" + CALL + "\n" + second)
    r = gpt.chat.completions.create(model="m", messages=HELLO, tools=OPENAI_TOOLS)
    msg = r.choices[0].message
    assert msg.content == "Counting." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("Bash", ARGS), ("Bash", {**ARGS, "timeout": "oops"})]

    engine.script(CALL)
    chunks = list(gpt.chat.completions.create(model="m", messages=HELLO, tools=OPENAI_TOOLS,
                                              stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls if c.function.name] == ["Bash"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_malformed_call_is_text(claude, gpt, engine) -> None:
    bad = "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</function>\n</tool_call>"
    engine.script(bad)
    m = claude.messages.create(model="m", max_tokens=200, messages=HELLO, tools=ANTHROPIC_TOOLS)
    assert [(b.type, b.text) for b in m.content] == [("text", bad)] and m.stop_reason == "end_turn"
    engine.script(bad)
    r = gpt.chat.completions.create(model="m", messages=HELLO, tools=OPENAI_TOOLS)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls


@pytest.fixture(scope="module")
def guides(default_model) -> GuideFactory:
    return GuideFactory(str(default_model), 8192, [3])


def test_a_forced_call_is_held_to_the_xml_form(claude, gpt, engine, guides,
                                               tiny_tokenizer) -> None:
    """tool_choice names a tool (or requires any): the prompt ends with the call's
    opening, the engine gets a grammar for the rest, and the answer (the grammar's end
    is `</function>`, then EOS) is the call."""
    cases = [
        (lambda: gpt.chat.completions.create(
            model="m", messages=HELLO, tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "Bash"}}),
         "<tool_call>\n<function=Bash>\n",
         "<parameter=command>\nls\n</parameter>\n</function>", ("Bash", {"command": "ls"})),
        (lambda: claude.messages.create(model="m", max_tokens=200, messages=HELLO,
                                        tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}),
         "<tool_call>\n<function=",
         "Read>\n<parameter=path>\n/etc/hosts\n</parameter>\n</function>",
         ("Read", {"path": "/etc/hosts"})),
    ]
    for create, opening, answer, expected in cases:
        engine.script(answer)
        r = create()
        request = engine.requests[-1]
        prompt = tiny_tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n" + opening)
        guide = guides.guide(request.grammar)
        ids = tiny_tokenizer.encode(answer, add_special_tokens=False).ids
        assert all(guide.accept(t) for t in ids) and guide.complete
        for bad in (answer.replace("<parameter=", "<parameter=x", 1),  # no such parameter
                    answer.replace("</parameter>", "</param>", 1)):  # the value never ends
            guide = guides.guide(request.grammar)
            ids = tiny_tokenizer.encode(bad, add_special_tokens=False).ids
            assert not (all(guide.accept(t) for t in ids) and guide.complete), bad
        if isinstance(r, anthropic.types.Message):
            assert [(b.name, b.input) for b in r.content] == [expected]
        else:
            [c] = r.choices[0].message.tool_calls
            assert (c.function.name, json.loads(c.function.arguments)) == expected


# Renders an assistant's calls as Qwen3-Coder's chat template does (written for this
# test): the text trimmed and a newline, then each call after a newline; a value as str()
# or JSON.
QWEN3_CODER_CALLS = ChatTemplate("""
{%- for m in messages %}{{ "<|im_start|>" + m.role }}
{%- if m.role == "assistant" and m.tool_calls %}
{%- if m.content and m.content | trim %}{{ "\\n" + m.content | trim + "\\n" }}{% endif %}
{%- for c in m.tool_calls %}{% set c = c.function if c.function is defined else c %}
{{- "\\n<tool_call>\\n<function=" + c.name + ">\\n" }}
{%- for k, v in c.arguments | items %}{{ "<parameter=" + k + ">\\n" }}
{%- if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}
{%- else %}{{ v | string }}{% endif %}{{ "\\n</parameter>\\n" }}
{%- endfor %}{{ "</function>\\n</tool_call>" }}{% endfor %}
{%- else %}{{ "\\n" + (m.content or "") }}{% endif %}{{ "<|im_end|>\\n" }}
{%- endfor %}""")


def test_the_call_renders_back_as_the_model_wrote_it(engine, tiny_tokenizer, claude) -> None:
    """Output -> tool_use -> the next request's assistant turn: the same text."""
    output = "Let me count them.\n\n" + CALL + "\n" + CALL.replace("30", "5")
    engine.script(output)
    m = claude.messages.create(model="m", max_tokens=200, messages=HELLO, tools=ANTHROPIC_TOOLS)
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    calls = [{"function": {"name": b.name, "arguments": b.input}} for b in m.content[1:]]
    turn = [{"role": "assistant", "content": m.content[0].text, "tool_calls": calls}]
    assert QWEN3_CODER_CALLS.render(turn, add_generation_prompt=False) == \
        f"<|im_start|>assistant\n{output}<|im_end|>\n"
