"""Reasoning (<think>...</think>) split from the answer, whatever the chunking; sent as
Anthropic thinking blocks (streamed and not, with signatures, before text and
tool_use) and as OpenAI reasoning_content; the request's thinking switch reaches the
chat template, and its budget the engine (as a span of token ids; the engine's side
is tests/scheduler/test_thinking.py)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.options import ShimOptions
from orchestrator.shim.reasoning import Answer, Reasoning, make_splitter, think_tag_ids
from orchestrator.shim.server import build_app
from orchestrator.shim.structured_output import after_reasoning, json_grammar
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_tool_parsers import chunkings
from wire.client import ThinkingSpan

TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]
HELLO = [{"role": "user", "content": "hi"}]
THOUGHT = '<think>\nThe user greets me. I should run ls.\n</think>\n\nHello!\n' \
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'


def split(text_chunks: list[str], prompt: str = "") -> list[Reasoning | Answer]:
    splitter = make_splitter("think", prompt)
    parts = [p for c in text_chunks for p in splitter.feed(c)] + splitter.finish()
    merged: list[Reasoning | Answer] = []
    for p in parts:
        if merged and type(merged[-1]) is type(p):
            merged[-1] = type(p)(merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


@pytest.mark.parametrize("text, prompt, expected", [
    ("<think>a b</think>\n\nThe answer.", "", [Reasoning("a b"), Answer("The answer.")]),
    ("\n<think>x</think>y", "", [Reasoning("x"), Answer("y")]),
    ("a b</think>\n\nThe answer.", "<|im_start|>assistant\n<think>\n",  # R1: opened in the prompt
     [Reasoning("a b"), Answer("The answer.")]),
    ("No reasoning here.", "", [Answer("No reasoning here.")]),
    ("<thinking>not a tag", "", [Answer("<thinking>not a tag")]),
    ("<think>cut off by max_tokens", "", [Reasoning("cut off by max_tokens")]),
    ("<think></think>\n\nDirect.", "", [Answer("Direct.")]),  # Qwen3 with thinking off
    ("<think>a < b and </thin is not the end</think>ok", "",
     [Reasoning("a < b and </thin is not the end"), Answer("ok")]),
])
def test_split(text, prompt, expected) -> None:
    for chunks in chunkings(text):
        assert split(chunks, prompt) == expected, chunks


def test_none_is_all_answer() -> None:
    splitter = make_splitter("none", "")
    assert splitter.feed("<think>x</think>") == [Answer("<think>x</think>")]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_splitter("o1", "")


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template):
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    options=ShimOptions(reasoning_parser="qwen3"))
    with TestClient(app) as c:
        yield c


def test_anthropic_thinking_blocks(client, engine) -> None:
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client,
                              max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    engine.script(THOUGHT)
    m = sdk.messages.create(model="m", max_tokens=200, messages=HELLO, tools=TOOLS,
                            thinking=thinking)
    engine.script(THOUGHT)
    with sdk.messages.stream(model="m", max_tokens=200, messages=HELLO, tools=TOOLS,
                             thinking=thinking) as s:
        streamed = s.get_final_message()
    for message in (m, streamed):
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
        think, text, use = message.content
        assert think.thinking == "\nThe user greets me. I should run ls.\n" and think.signature
        assert text.text == "Hello!" and use.input == {"command": "ls"}
        assert message.stop_reason == "tool_use"
    # the client sends the thinking block back: accepted, and the turn goes on
    engine.script("Done.")
    m = sdk.messages.create(model="m", max_tokens=50, thinking=thinking, tools=TOOLS, messages=[
        *HELLO, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "a.py"}]}])
    assert m.content[0].text == "Done."


def test_openai_reasoning_content(client, engine) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    engine.script("<think>hmm</think>\n\nHi.")
    r = sdk.chat.completions.create(model="m", messages=HELLO)
    assert (r.choices[0].message.content, r.choices[0].message.reasoning_content) == ("Hi.", "hmm")
    engine.script("<think>hmm</think>\n\nHi.")
    chunks = list(sdk.chat.completions.create(model="m", messages=HELLO, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hmm"
    assert "".join(d.content or "" for d in deltas) == "Hi."


THINK, END_THINK = 6, 7  # the tiny tokenizer's <think> and </think>


def test_the_budget_reaches_the_engine_and_reasoning_tokens_are_counted(client, engine) -> None:
    """Anthropic budget_tokens and OpenAI (vLLM) thinking_token_budget become the span's
    budget; without one the span is still sent, to count the reasoning tokens (OpenAI
    usage.completion_tokens_details.reasoning_tokens)."""
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client,
                              max_retries=0)
    engine.script(THOUGHT)
    sdk.messages.create(model="m", max_tokens=200, messages=HELLO,
                        thinking={"type": "enabled", "budget_tokens": 1024})
    assert engine.requests[-1].thinking == ThinkingSpan(THINK, END_THINK, budget=1024)
    for body, budget in (({"thinking_token_budget": 64}, 64), ({}, None)):
        engine.script("<think>hmm, let me see</think>\n\nHi.")
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, **body})
        assert engine.requests[-1].thinking == ThinkingSpan(THINK, END_THINK, budget=budget)
        reasoning = len(engine.tokenizer.encode("hmm, let me see").ids)
        assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning}
    for bad in (0, -1, 1.5, "8", True):
        r = client.post("/v1/chat/completions", json={
            "model": "m", "messages": HELLO, "thinking_token_budget": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO,
                                              "thinking": {"type": "enabled",
                                                           "budget_tokens": bad}})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_formatted_answer_without_a_span_loses_its_leading_whitespace(client, engine) -> None:
    """The format's grammar lets the answer start with what follows a span ("\n\n"):
    without one, that whitespace is not part of the content either."""
    engine.script('\n\n{"a": 1}')
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO,
                                                  "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    engine.script('\n\n{"a": 1}')  # unformatted: the model's text as it is
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO})
    assert r.json()["choices"][0]["message"]["content"] == '\n\n{"a": 1}'


def test_no_span_where_a_tag_is_not_one_token_the_text_keeps(tiny_tokenizer) -> None:
    """A special tag is dropped from the text (the splitter would never see the span the
    engine follows); a tag that is no single token cannot be followed by id."""
    assert think_tag_ids(tiny_tokenizer) == (THINK, END_THINK)
    spec = json.loads(tiny_tokenizer.to_str())
    for token in spec["added_tokens"]:
        token["special"] = token["special"] or token["content"] == "</think>"
    assert think_tag_ids(Tokenizer.from_str(json.dumps(spec))) is None
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</think>"]
    del spec["model"]["vocab"]["</think>"]
    assert think_tag_ids(Tokenizer.from_str(json.dumps(spec))) is None


def test_the_server_caps_every_budget(engine, tiny_tokenizer, tiny_template) -> None:
    """--max-thinking-tokens: a cap on top of each request's own budget, and the budget
    of a request without one."""
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    options=ShimOptions(reasoning_parser="qwen3", max_thinking_tokens=50))
    with TestClient(app) as c:
        for extra, budget in (({"thinking_token_budget": 10}, 10),
                              ({"thinking_token_budget": 1000}, 50), ({}, 50)):
            engine.script("Hi.")
            c.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, **extra})
            assert engine.requests[-1].thinking.budget == budget


def test_the_span_follows_the_template(engine, tiny_tokenizer) -> None:
    """A prompt that opens <think> (R1) starts the span inside; a parser without
    reasoning sends no span."""
    template = ChatTemplate("{{ messages[-1].content }}<think>\n")
    for parser, expected in (("deepseek_r1", ThinkingSpan(THINK, END_THINK, inside=True)),
                             ("none", None)):
        app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=template,
                        options=ShimOptions(reasoning_parser=parser))
        with TestClient(app) as c:
            engine.script("a b</think>Hi.")
            c.post("/v1/chat/completions", json={"model": "m", "messages": HELLO})
            assert engine.requests[-1].thinking == expected


def test_the_thinking_switch_reaches_the_template(engine, tiny_tokenizer) -> None:
    """Anthropic's `thinking` (enabled / disabled) and OpenAI's (vLLM's)
    chat_template_kwargs.enable_thinking; neither given: the template's default."""
    template = ChatTemplate("{{ messages[-1].content }}|{{ enable_thinking if enable_thinking "
                            "is defined else 'default' }}|")
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=template,
                    options=ShimOptions(reasoning_parser="think"))
    prompts = []
    with TestClient(app) as c:
        for body in ({}, {"thinking": {"type": "enabled", "budget_tokens": 2048}},
                     {"thinking": {"type": "disabled"}}):
            c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO,
                                         **body})
            prompts.append(tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids))
        for body in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            c.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, **body})
            prompts.append(tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids))
        bad = c.post("/v1/chat/completions", json={"model": "m", "messages": HELLO,
                                                   "chat_template_kwargs": {"enable_thinking": 1}})
    assert prompts == ["hi|default|", "hi|True|", "hi|False|", "hi|default|", "hi|False|"]
    assert bad.status_code == 400


def test_a_reasoning_model_thinks_before_a_formatted_answer(engine, tiny_tokenizer) -> None:
    """With a response format, the engine gets the span and the format's grammar, which
    holds the answer after the span (scheduler/thinking.py); the answer is content,
    and a JSON answer with a "name" is not a tool call. A forced call sends no span
    (its opening ends the prompt); without reasoning, the grammar is the format's."""
    template = ChatTemplate("{{ messages[-1].content }}<think>\n")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    json_object = {"response_format": {"type": "json_object"}}
    for parser in ("deepseek_r1", "none"):
        app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=template,
                        options=ShimOptions(reasoning_parser=parser,
                                            tool_call_parser="llama3_json"))
        with TestClient(app) as c:
            engine.script('Bob is 3.</think>\n\n{"name": "Bob", "age": 3}' if parser != "none"
                          else '{"name": "Bob", "age": 3}')
            r = c.post("/v1/chat/completions", json={
                "model": "m", "messages": HELLO, "tools": tools, **json_object})
            message = r.json()["choices"][0]["message"]
            assert message["content"] == '{"name": "Bob", "age": 3}'
            assert "tool_calls" not in message
            sent = engine.requests[-1]
            if parser == "none":
                assert "reasoning_content" not in message and sent.thinking is None
                assert sent.grammar == json_grammar({"type": "object"}, "response_format")
            else:
                assert message["reasoning_content"] == "Bob is 3."
                assert sent.thinking == ThinkingSpan(THINK, END_THINK, inside=True)
                assert sent.grammar == after_reasoning(json_grammar({"type": "object"}, "r"))
            engine.script('"x"}')
            c.post("/v1/chat/completions", json={
                "model": "m", "messages": HELLO, "tools": tools, "tool_choice": "required"})
            assert engine.requests[-1].thinking is None


@settings(max_examples=300, deadline=None)
@given(reasoning=st.text(st.sampled_from("ab <>/\n").map(str), max_size=30).filter(
           lambda t: "</think>" not in t),
       answer=st.text(st.sampled_from("xy <>/\n").map(str), max_size=30),
       opened_in_prompt=st.booleans(), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_split_keeps_every_character(reasoning, answer, opened_in_prompt, cuts) -> None:
    """Whatever the text and its chunking: the reasoning comes back whole, and the
    answer too, less only the whitespace that follows </think>."""
    text = ("" if opened_in_prompt else "<think>") + reasoning + "</think>" + answer
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    parts = split(chunks, "<think>\n" if opened_in_prompt else "")
    assert "".join(p.text for p in parts if isinstance(p, Reasoning)) == reasoning
    assert "".join(p.text for p in parts if isinstance(p, Answer)) == answer.lstrip()
