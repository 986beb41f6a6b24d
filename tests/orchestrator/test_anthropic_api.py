"""The Anthropic Messages API on scripted engine outputs: SSE event order with `event:`
lines, tool_use parsed and streamed as input_json_delta, usage, stop reasons, the
clamp of max_tokens, errors in Anthropic's shape with the statuses Claude Code acts on,
and the official SDK parsing all of it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from starlette.testclient import TestClient

from orchestrator.shim.options import ShimOptions
from orchestrator.shim.server import build_app
from tests.orchestrator.claude_code_body import claude_code_request
from tests.orchestrator.scripted_engine import ScriptedEngine

TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=4096)


def make_client(engine, tokenizer, template, *, api_key: str | None = None,
                ping_interval_s: float = 5.0, **options: Any) -> TestClient:
    """The app, with `options` the ShimOptions fields to set."""
    app = build_app(engine, tokenizer, model_name="tiny", chat_template=template,
                    api_key=api_key, ping_interval_s=ping_interval_s,
                    options=ShimOptions(**options))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        yield c


@pytest.fixture
def sdk(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client,
                               max_retries=0)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event, data) pairs; every data line must have its event line."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        kind, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == kind
        out.append((kind, data))
    return out


def post(client: TestClient, body: dict, **kw) -> object:
    return client.post("/v1/messages?beta=true", json={"model": "m", "max_tokens": 50, **body},
                       **kw)


def assert_error(r, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == type_
    return body["error"]["message"]


# --- responses -------------------------------------------------------------------------


def test_create_text(sdk, engine) -> None:
    engine.script("Hello there.", num_device_cached=16, num_host_cached=16)
    m = sdk.messages.create(model="claude-x", max_tokens=50, messages=HELLO,
                            system="Be brief and kind. " * 10)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello there."
    assert (m.role, m.model, m.stop_reason, m.stop_sequence) == (
        "assistant", "claude-x", "end_turn", None)
    n = len(engine.requests[0].prompt_token_ids)
    assert n > 64
    u = m.usage
    assert u.cache_read_input_tokens == 32
    assert u.cache_creation_input_tokens == n // 16 * 16 - 32
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == n
    assert u.output_tokens == len(engine.tokenizer.encode(
        "Hello there.", add_special_tokens=False).ids) + 1  # + EOS


def test_stream_event_order_with_event_lines(client, engine) -> None:
    engine.script("Let me check.\n" + CALL)
    r = post(client, {"messages": HELLO, "tools": TOOLS, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [d for k, d in events if k == "content_block_start"]
    assert [b["content_block"]["type"] for b in blocks] == ["text", "tool_use"]
    assert [b["index"] for b in blocks] == [0, 1]
    tool_deltas = [d["delta"] for k, d in events
                   if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(d["partial_json"] for d in tool_deltas)) == {"command": "ls"}
    text = "".join(d["delta"]["text"] for k, d in events
                   if k == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "Let me check."
    assert kinds.count("content_block_stop") == 2
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    out = engine.tokenizer.encode("Let me check.\n" + CALL, add_special_tokens=False).ids
    assert delta["usage"]["output_tokens"] == len(out) + 1


def test_sdk_stream_and_tool_round_trip(sdk, engine) -> None:
    engine.script("Let me check.\n" + CALL)
    with sdk.messages.stream(model="m", max_tokens=100, messages=HELLO, tools=TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    text, use = final.content
    assert text.text == "Let me check." and (use.name, use.input) == ("Bash", {"command": "ls"})
    assert use.id.startswith("toolu_")

    # The client sends the tool_use back with its result: the new prompt extends the
    # previous prompt plus the model's output token for token.
    engine.script("Two files.")
    messages = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "a.py\nb.py"}]}]
    m = sdk.messages.create(model="m", max_tokens=100, messages=messages, tools=TOOLS)
    assert m.content[0].text == "Two files." and m.stop_reason == "end_turn"
    first, second = engine.requests
    out = engine.tokenizer.encode("Let me check.\n" + CALL, add_special_tokens=False).ids
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(out)] == \
        first.prompt_token_ids + out
    assert client_breaks(sdk) == 0


def client_breaks(sdk: anthropic.Anthropic) -> float:
    app = sdk._client.app  # the TestClient's app
    return app.state.shim.metrics.registry.get_sample_value("deepinfer_prefix_breaks_total")


def test_malformed_tool_call_is_text(sdk, engine) -> None:
    bad = '<tool_call>\n{"name": "Bash", "arguments": {"command": \n</tool_call>'
    engine.script(bad)
    m = sdk.messages.create(model="m", max_tokens=100, messages=HELLO, tools=TOOLS)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == bad
    assert m.stop_reason == "end_turn"


def test_tool_choice_none_leaves_calls_as_text(sdk, engine) -> None:
    engine.script(CALL)
    m = sdk.messages.create(model="m", max_tokens=100, messages=HELLO, tools=TOOLS,
                            tool_choice={"type": "none"})
    assert m.content[0].type == "text"


TWO_TOOLS = TOOLS + [{"name": "Read", "input_schema": {"type": "object"}}]


def test_tool_choice_tool_forces_the_call(sdk, engine, tiny_tokenizer) -> None:
    """type "tool": the prompt ends with the start of that call, so the answer is its
    arguments (Anthropic prefills the same way); without parallel calls the answer ends
    at the first call."""
    engine.script('{"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "Read", '
                  '"arguments": {}}\n</tool_call>')
    m = sdk.messages.create(model="m", max_tokens=100, messages=HELLO, tools=TWO_TOOLS,
                            tool_choice={"type": "tool", "name": "Bash",
                                         "disable_parallel_tool_use": True})
    prompt = tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids,
                                   skip_special_tokens=False)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "Bash", "arguments": ')
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "Bash",
                                                                 {"command": "ls"})]
    assert m.stop_reason == "tool_use" and engine.aborted[-1][1] == "stop"
    # "any" with one tool names it; with several, the model names one
    for tools, ending in ((TOOLS, '{"name": "Bash", "arguments": '), (TWO_TOOLS, '{"name": "')):
        engine.script('Read", "arguments": {}}\n</tool_call>')
        m = sdk.messages.create(model="m", max_tokens=100, messages=HELLO, tools=tools,
                                tool_choice={"type": "any"})
        prompt = tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids,
                                       skip_special_tokens=False)
        assert prompt.endswith(ending)
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "Read")]


def test_a_whole_call_is_tool_use_even_if_the_model_wrote_on(sdk, engine) -> None:
    """Cut by max_tokens after a complete call: an agent told "max_tokens" would not run
    the call, so it is "tool_use"."""
    engine.script(CALL + "\nand then some more words that run on", eos=False)
    m = sdk.messages.create(model="m", max_tokens=30, messages=HELLO, tools=TOOLS)
    assert m.usage.output_tokens == 30 and m.stop_reason == "tool_use"
    assert [b.type for b in m.content][:1] == ["tool_use"]


def test_stop_reasons(sdk, engine) -> None:
    engine.script("one two three four", eos=False)
    m = sdk.messages.create(model="m", max_tokens=2, messages=HELLO)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    engine.script("one two STOP three")
    m = sdk.messages.create(model="m", max_tokens=50, messages=HELLO, stop_sequences=["STOP"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == (
        "stop_sequence", "STOP", "one two ")
    assert engine.aborted[-1][1] == "stop"


@pytest.mark.parametrize("per_output", [1, 3, 8])
def test_stop_sequence_in_a_several_token_output(sdk, engine, per_output) -> None:
    """Speculative decoding sends several tokens per output: the text ends before the stop
    sequence and output_tokens counts up to the token completing it, however grouped."""
    engine.script("one two STOP three four five", per_output=per_output)
    m = sdk.messages.create(model="m", max_tokens=50, messages=HELLO, stop_sequences=["STOP"])
    assert (m.stop_reason, m.content[0].text) == ("stop_sequence", "one two ")
    upto = engine.tokenizer.encode("one two STOP", add_special_tokens=False).ids
    assert m.usage.output_tokens == len(upto)


def test_streamed_several_token_outputs_with_a_stop_sequence(sdk, engine) -> None:
    """Streaming with speculative decoding: a drafted step's tokens arrive in one output
    and stream as they come; the streamed text, stop and usage are what one token per
    output gives."""
    runs = []
    for per_output in (1, 3):
        engine.script("one two three STOP four five", per_output=per_output)
        with sdk.messages.stream(model="m", max_tokens=50, messages=HELLO,
                                 stop_sequences=["STOP"]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        runs.append((text, final.stop_reason, final.usage.output_tokens))
    upto = engine.tokenizer.encode("one two three STOP", add_special_tokens=False).ids
    assert runs[0] == runs[1] == ("one two three ", "stop_sequence", len(upto))


def test_length_stop_reason_names_the_limit(engine, tiny_tokenizer, tiny_template) -> None:
    """The request's max_tokens -> "max_tokens"; the server's --max-output-tokens ends the
    turn ("end_turn": Claude Code treats "max_tokens" as its own limit exceeded and
    fails); the end of the context -> "model_context_window_exceeded"."""
    long = "one two three four five six seven eight nine ten " * 4
    engine.max_model_len = 64
    with make_client(engine, tiny_tokenizer, tiny_template, max_output_tokens=5) as c:
        reasons = []
        for max_tokens in (3, 128000):
            engine.script(long, eos=False)
            r = post(c, {"messages": HELLO, "max_tokens": max_tokens})
            reasons.append((r.json()["stop_reason"], r.json()["usage"]["output_tokens"]))
        assert reasons == [("max_tokens", 3), ("end_turn", 5)]
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        engine.script(long, eos=False)
        r = post(c, {"messages": HELLO, "max_tokens": 128000})
    n = len(engine.requests[-1].prompt_token_ids)
    assert r.json()["stop_reason"] == "model_context_window_exceeded"
    assert r.json()["usage"]["output_tokens"] == 64 - n


def test_ping_while_waiting(engine, tiny_tokenizer, tiny_template) -> None:
    engine.script("slow", delay_s=0.3)
    with make_client(engine, tiny_tokenizer, tiny_template, ping_interval_s=0.1) as c:
        r = post(c, {"messages": HELLO, "stream": True})
    kinds = [k for k, _ in sse_events(r.text)]
    assert kinds[0] == "message_start" and "ping" in kinds and kinds[-1] == "message_stop"


def test_max_tokens_is_clamped_and_capped(engine, tiny_tokenizer, tiny_template) -> None:
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        assert post(c, {"messages": HELLO, "max_tokens": 128000}).status_code == 200
    n = len(engine.requests[-1].prompt_token_ids)
    assert engine.requests[-1].max_tokens == 4096 - n
    with make_client(engine, tiny_tokenizer, tiny_template, max_output_tokens=7) as c:
        assert post(c, {"messages": HELLO, "max_tokens": 128000}).status_code == 200
        assert post(c, {"messages": HELLO, "max_tokens": 3}).status_code == 200
    assert [r.max_tokens for r in engine.requests[-2:]] == [7, 3]


def test_claude_code_shaped_request_is_accepted(client, engine) -> None:
    body, headers = claude_code_request("3f2a9c1e-0000-4000-8000-000000000001")
    engine.script("Hello!")
    r = client.post("/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    kinds = [k for k, _ in sse_events(r.text)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    req = engine.requests[-1]
    assert req.session_id and "3f2a9c1e" in req.session_id
    assert req.sampling.temperature == 1.0
    for version in ("2023-06-01", "2026-10-21"):
        engine.script("ok")
        body["stream"] = False
        r = client.post("/v1/messages", json=body, headers={**headers,
                                                            "anthropic-version": version})
        assert r.status_code == 200 and r.json()["type"] == "message"


def test_a_temperature_too_small_to_sample_with_is_accepted(client, engine) -> None:
    """logits / 1e-300 overflows to inf and NaN (found by the fuzzer: it stopped the
    engine). The rank's sampler treats such temperatures as greedy, whoever sent them
    (tests/worker/test_units.py); the shim passes them on unchanged."""
    for temperature in (1e-300, 5e-324, 1e-5, 0.7):
        engine.script("x")
        r = post(client, {"messages": HELLO, "temperature": temperature})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].sampling.temperature == temperature


def test_count_tokens_matches_the_prompt(client, engine, sdk) -> None:
    body, headers = claude_code_request("s1", stream=False)
    engine.script("x")
    assert client.post("/v1/messages", json=body, headers=headers).status_code == 200
    del body["max_tokens"]
    r = client.post("/v1/messages/count_tokens?beta=true", json=body, headers=headers)
    assert r.status_code == 200
    assert r.json() == {"input_tokens": len(engine.requests[-1].prompt_token_ids)}
    assert sdk.messages.count_tokens(model="m", messages=HELLO).input_tokens > 0


def test_models(sdk) -> None:
    [model] = sdk.models.list().data
    assert model.id == "tiny" and model.type == "model"


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("body, fragment", [
    ({"messages": []}, "at least one message"),
    ({"messages": "hi"}, "messages: Input should be a list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "'type'"),
    ({"messages": HELLO, "max_tokens": "many"}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": None}, "max_tokens: Field required"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "top_k": 2**63}, "top_k"),
    ({"messages": HELLO, "top_k": -3}, "top_k"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": HELLO, "stop_sequences": "END"}, "stop_sequences"),
    ({"messages": HELLO, "tools": [{"name": "f", "input_schema": "x"}]}, "input_schema"),
    ({"messages": HELLO, "system": 7}, "system"),
    ({"messages": HELLO, "tool_choice": {"type": "some"}}, "tool_choice: Input should be"),
    ({"messages": HELLO, "tool_choice": "auto"}, "tool_choice: Input should be"),
    ({"messages": HELLO, "tool_choice": {"type": "any"}}, "the request has no tools"),
    ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "Rm"}},
     "no tool named 'Rm'"),
    ({"messages": HELLO, "tools": TOOLS,
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "disable_parallel_tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
     'messages.0.content.0.type: unknown content block type "nope"'),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "not base64!"}}]}]}, "not valid base64"),
    ({"messages": HELLO, "cache_salt": 7}, "cache_salt: Input should be a non-empty string"),
    ({"messages": HELLO, "cache_salt": "s" * 257}, "at most 256 characters"),
])
def test_bad_requests_are_400(client, engine, body, fragment) -> None:
    for stream in (False, True):
        r = post(client, {**body, "stream": stream} if "stream" not in body else body)
        assert fragment in assert_error(r, 400, "invalid_request_error")
    assert engine.requests == []


def test_unknown_fields_are_ignored_and_known_blocks_kept(client, engine) -> None:
    engine.script("ok")
    r = post(client, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "citations": None, "future_field": 1},
        {"type": "search_result", "source": "x"}]}],
        "brand_new_option": {"a": 1}, "container": None, "service_tier": "auto"})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_token_ids,
                                     skip_special_tokens=False)
    assert "hi\n[search_result; not available on this server]" in prompt


def test_thinking_blocks_with_signatures_are_accepted(client, engine) -> None:
    """Claude Code echoes a previous turn's thinking (with its signature) back."""
    engine.script("ok")
    r = post(client, {"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [
        *HELLO,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Let me think.", "signature": "c2lnbmF0dXJl"},
            {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
            {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "ok"


def test_invalid_json_and_oversize_body(engine, tiny_tokenizer, tiny_template) -> None:
    with make_client(engine, tiny_tokenizer, tiny_template, max_request_bytes=1000) as c:
        r = c.post("/v1/messages", content=b'{"messages": [', headers={
            "content-type": "application/json"})
        assert "not valid JSON" in assert_error(r, 400, "invalid_request_error")
        assert_error(c.post("/v1/messages", json=["a list"]), 400, "invalid_request_error")
        big = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 2000}]}
        assert_error(c.post("/v1/messages", json=big), 413, "request_too_large")
        # Chunked upload, no content-length: still cut at the limit.
        data = json.dumps(big).encode()
        r = c.post("/v1/messages", content=iter([data[:600], data[600:]]))
        assert_error(r, 413, "request_too_large")
    assert engine.requests == []


def test_prompt_too_long_has_the_text_claude_code_recognises(engine, tiny_tokenizer,
                                                             tiny_template) -> None:
    engine.max_model_len = 64
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        r = post(c, {"messages": [{"role": "user", "content": "hello there " * 50}]})
    msg = assert_error(r, 400, "invalid_request_error")
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 63 maximum", msg)


def test_auth(engine, tiny_tokenizer, tiny_template) -> None:
    with make_client(engine, tiny_tokenizer, tiny_template, api_key="sekret") as c:
        assert_error(post(c, {"messages": HELLO}), 401, "authentication_error")
        assert_error(post(c, {"messages": HELLO}, headers={"x-api-key": "nope"}), 401,
                     "authentication_error")
        engine.script("a")
        assert post(c, {"messages": HELLO}, headers={"x-api-key": "sekret"}).status_code == 200
        engine.script("b")
        assert post(c, {"messages": HELLO},
                    headers={"authorization": "Bearer sekret"}).status_code == 200


def test_not_found_in_anthropic_shape(client) -> None:
    assert_error(client.post("/v1/messages/batches", json={}), 404, "not_found_error")
    assert_error(client.get("/v1/messages"), 405, "invalid_request_error")


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_529_with_retry_after(client, engine, stream) -> None:
    engine.script("x", error_type="overloaded")
    r = post(client, {"messages": HELLO, "stream": stream})
    assert_error(r, 529, "overloaded_error")
    assert r.headers["retry-after"].isdigit()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_before_output_is_500_api_error(client, engine, stream) -> None:
    engine.script("x", error_type="internal")
    assert_error(post(client, {"messages": HELLO, "stream": stream}), 500, "api_error")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_unavailable_is_503_api_error_with_retry_after(client, engine, stream) -> None:
    engine.script("x", error_type="unavailable")
    r = post(client, {"messages": HELLO, "stream": stream})
    assert_error(r, 503, "api_error")
    assert r.headers["retry-after"].isdigit()


def test_mid_stream_failure_is_an_error_event(client, engine) -> None:
    engine.script("a b c d e f", error_type="internal", error_after=3)
    r = post(client, {"messages": HELLO, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[0][0] == "message_start"
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": "boom"}})


def test_engine_gone_is_an_error(client, engine) -> None:
    engine.connected = False
    assert_error(post(client, {"messages": HELLO}), 503, "api_error")


def test_internal_bug_is_500_api_error(client, engine, monkeypatch) -> None:
    def broken(*a, **k):
        raise RuntimeError("bug")
    monkeypatch.setattr("orchestrator.shim.anthropic_response.prepare_chat", broken)
    assert_error(post(client, {"messages": HELLO}), 500, "api_error")


def test_the_engine_hears_how_each_answer_ended(client, engine) -> None:
    """TurnEnd: an answer that ends in a tool call keeps its session's blocks retained
    (the agent comes back with the result), one without lets them go (scheduler
    `end_turn`); streamed or not."""
    engine.script("Let me check.\n" + CALL)
    post(client, {"messages": HELLO, "tools": TOOLS, "stream": True})
    engine.script("Two files.")
    post(client, {"messages": HELLO, "tools": TOOLS})
    assert [tool for _, tool in engine.turn_ends] == [True, False]
    assert [rid for rid, _ in engine.turn_ends] == [r.request_id for r in engine.requests]
