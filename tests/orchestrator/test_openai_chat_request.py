"""OpenAI chat completions on scripted engine outputs, through the official SDK: text,
streaming with usage, tool calls out and back in, errors in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from orchestrator.shim.server import build_app
from tests.orchestrator.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                         max_retries=0)


def test_create(sdk, engine) -> None:
    engine.script("Hello there.", num_device_cached=16)
    r = sdk.chat.completions.create(model="m", messages=HELLO, max_tokens=20)
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason, r.object) == (
        "Hello there.", "stop", "chat.completion")
    assert r.usage.prompt_tokens == len(engine.requests[0].prompt_token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 16
    assert engine.requests[0].max_tokens == 20


def test_stream_with_usage(sdk, engine) -> None:
    engine.script("Hello there.")
    chunks = list(sdk.chat.completions.create(
        model="m", messages=HELLO, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_tool_calls_round_trip(sdk, engine) -> None:
    engine.script("Checking.\n" + CALL)
    r = sdk.chat.completions.create(model="m", messages=HELLO, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    [call] = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    engine.script("Sunny.")
    messages = [*HELLO, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    r2 = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "Sunny."
    first, second = engine.requests
    out = engine.tokenizer.encode("Checking.\n" + CALL, add_special_tokens=False).ids
    n = len(first.prompt_token_ids) + len(out)
    assert second.prompt_token_ids[:n] == first.prompt_token_ids + out


def test_stream_tool_calls(sdk, engine) -> None:
    engine.script(CALL)
    chunks = list(sdk.chat.completions.create(model="m", messages=HELLO, tools=TOOLS,
                                              stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "nope"}]}]}, "messages"),
    ({"messages": HELLO, "cache_salt": ["a"]}, "cache_salt"),
    ({"messages": HELLO, "cache_salt": ""}, "cache_salt"),
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "max_tokens": "9"}, "max_tokens"),
    ({"messages": HELLO, "temperature": 3}, "temperature"),
    ({"messages": HELLO, "stop": 4}, "stop"),
])
def test_bad_requests(client, engine, body, param) -> None:
    r = client.post("/v1/chat/completions", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert engine.requests == []


def test_tool_choice_required_and_named(sdk, client, engine, tiny_tokenizer) -> None:
    """"required" with one tool, or a named function: the prompt ends with the start of
    that call; parallel_tool_calls=False keeps only the first call."""
    second = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        engine.script('{"city": "Paris"}}\n</tool_call>' + second)
        r = sdk.chat.completions.create(model="m", messages=HELLO, tools=TOOLS,
                                        tool_choice=choice, parallel_tool_calls=False)
        prompt = tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids,
                                       skip_special_tokens=False)
        assert prompt.endswith('assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
        calls = r.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
        assert r.choices[0].finish_reason == "tool_calls"
    assert 'deepinfer_guided_requests_total{by="tool_choice"} 2.0' in client.get("/metrics").text


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "sometimes", "tools": TOOLS}, "'tool_choice' must be"),
    ({"tool_choice": "required"}, "the request has no tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": TOOLS},
     "no tool named 'f'"),
    ({"parallel_tool_calls": "no", "tools": TOOLS}, "'parallel_tool_calls'"),
])
def test_bad_tool_choice(client, engine, body, message) -> None:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert engine.requests == []


def test_stream_keeps_the_connection_busy_while_waiting(engine, tiny_tokenizer,
                                                        tiny_template) -> None:
    """The role chunk after ping_interval_s without output, then SSE comments: a tool
    call is held until whole, and a proxy's read timeout must not cut it."""
    engine.script(CALL, delay_s=0.15)
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    ping_interval_s=0.1)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": HELLO,
                                                 "tools": TOOLS, "stream": True})
    blocks = r.text.strip().split("\n\n")
    assert json.loads(blocks[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert ": ping" in blocks[1:-3] and blocks[-1] == "data: [DONE]"
    calls = [json.loads(b[6:])["choices"][0]["delta"].get("tool_calls") for b in blocks
             if b.startswith("data: {")]
    assert [c[0]["function"]["name"] for c in calls if c] == ["get_weather"]
    # /v1/completions too, while a request waits for its first token
    engine.script("slow", delay_s=0.35)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    blocks = r.text.strip().split("\n\n")
    assert blocks[0] == ": ping" and blocks[-1] == "data: [DONE]"
    assert "".join(json.loads(b[6:])["choices"][0]["text"] for b in blocks
                   if b.startswith("data: {")) == "slow"


def test_empty_answer_and_null_max_completion_tokens(sdk, client, engine) -> None:
    """An empty answer's content is "" (null only beside tool calls); a null
    max_completion_tokens leaves max_tokens in force."""
    engine.script("")
    r = client.post("/v1/chat/completions", json={
        "model": "m", "messages": HELLO, "max_completion_tokens": None, "max_tokens": 5})
    assert r.json()["choices"][0]["message"]["content"] == ""
    assert engine.requests[-1].max_tokens == 5
    engine.script(CALL)
    r = sdk.chat.completions.create(model="m", messages=HELLO, tools=TOOLS)
    assert r.choices[0].message.content is None and r.choices[0].message.tool_calls


def test_overloaded_is_429(client, engine) -> None:
    engine.script("x", error_type="overloaded")
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO,
                                                  "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"].isdigit()
    assert r.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("seed", -(2**63) - 1),
                                          ("top_k", 10**30), ("max_tokens", 2**63)])
def test_integers_past_64_bits_are_refused(field, value) -> None:
    """They would fail to encode for the engine after validation: a 500 the fuzzer found."""
    from orchestrator.shim.errors import ApiError
    from orchestrator.shim.openai_request import parse_chat_request

    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": HELLO, field: value}, {})
    assert (info.value.status, info.value.param) == (400, field)
