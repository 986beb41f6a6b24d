"""The chat APIs against the real engine (`deepinfer-run serve`, 4 ranks on gloo), driven
by the official `anthropic` and `openai` SDKs and by request bodies shaped like Claude
Code's. The model has random weights, so these tests check what the server promises
whatever the text: every response parses, usage adds up, prefixes are shared across
sessions past the billing header, an agent conversation never breaks its prefix, bad
input gets the right error, and a client that leaves mid-stream frees its sequence.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.orchestrator.claude_code_body import claude_code_request, first_user_turn
from tests.orchestrator.e2e_helpers import Served

pytestmark = pytest.mark.slow

MAX_OUTPUT = 24  # --max-output-tokens: Claude Code asks for 128000 (random text, CPU)
GREEDY = {"temperature": 0}
TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    engine = Served(default_model, tmp_path_factory.mktemp("chat") / "run",
                    extra_args=["--max-output-tokens", str(MAX_OUTPUT)])
    yield engine
    assert engine.stop() == 0, engine.log()[-3000:]


@pytest.fixture(scope="module")
def claude(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="dummy", max_retries=0,
                               timeout=300)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            assert kind is not None, f"data line without an event line: {line}"
            events.append((kind, json.loads(line[6:])))
            kind = None
    return events


def claude_code_turn(url: str, session: str, messages: list | None = None) -> dict[str, Any]:
    """One Claude-Code-shaped streaming request; returns the final usage and content."""
    body, headers = claude_code_request(session, messages)
    body["temperature"] = 0
    with httpx.stream("POST", f"{url}/v1/messages?beta=true", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = sse(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    text = "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta")
    delta = [d for k, d in events if k == "message_delta"][0]
    return {"usage": delta["usage"], "text": text, "stop_reason": delta["delta"]["stop_reason"]}


def test_anthropic_sdk_create_stream_count_tokens(claude) -> None:
    messages = [{"role": "user", "content": "Write a haiku about caches."}]
    kw = dict(model="tiny", max_tokens=12, messages=messages, system="You are terse.",
              tools=TOOLS, extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    u = m.usage
    total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
    count = claude.messages.count_tokens(model="tiny", messages=messages,
                                         system="You are terse.", tools=TOOLS)
    assert count.input_tokens == total
    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        streamed = s.get_final_message()
    assert "message_start" in events and "message_stop" in events
    assert [b.model_dump(exclude={"parsed_output"}) for b in streamed.content] == [
        b.model_dump() for b in m.content]
    assert streamed.usage.cache_read_input_tokens >= (total - 1) // 16 * 16 > 0
    assert [model.id for model in claude.models.list().data] == ["tiny-llama"]


def test_anthropic_tool_round_trip(claude) -> None:
    """A conversation with an assistant tool_use turn and a tool_result is accepted, and
    the SDK parses the answer (the model is random: its reply is whatever it is)."""
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py\nb.py"},
            {"type": "text", "text": "Which one is the entry point?"}]},
    ]
    m = claude.messages.create(model="tiny", max_tokens=8, messages=messages, tools=TOOLS,
                               extra_body=GREEDY)
    assert m.content and m.usage.output_tokens >= 1
    with claude.messages.stream(model="tiny", max_tokens=8, messages=messages, tools=TOOLS,
                                extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in streamed.content] == [
        b.model_dump() for b in m.content]


def test_openai_sdk_chat(served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {
        "name": "Bash", "parameters": TOOLS[0]["input_schema"]}}]
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    r = client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(client.chat.completions.create(
        model="x", messages=messages, tools=tools, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (r.choices[0].message.content or "")
    usage = chunks[-1].usage
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= (usage.prompt_tokens - 1) // 16 * 16
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_structured_outputs_and_forced_tool_calls(served, claude) -> None:
    """Unguided, the random model never writes JSON; guided by a schema (OpenAI
    response_format, Anthropic output_config) or a forced tool call (tool_choice), it
    writes what the schema allows, sampled or greedy."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}

    def valid(value: dict) -> bool:
        return set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue") \
            and isinstance(value["ok"], bool)

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=300)
    hello = [{"role": "user", "content": "Pick a color."}]
    for temperature in (0, 1):
        r = client.chat.completions.create(
            model="x", messages=hello, temperature=temperature, seed=1, response_format={
                "type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
        assert valid(json.loads(r.choices[0].message.content)), r.choices[0].message.content
    m = claude.messages.create(model="tiny", max_tokens=100, messages=hello, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert valid(json.loads(m.content[0].text)) and m.stop_reason == "end_turn"
    tools = [{"name": "Pick", "input_schema": schema},
             {"name": "Done", "input_schema": {"type": "object", "properties": {},
                                               "additionalProperties": False}}]
    for choice in ({"type": "tool", "name": "Pick"}, {"type": "any"}):
        m = claude.messages.create(model="tiny", max_tokens=100, messages=hello, tools=tools,
                                   tool_choice=choice, extra_body=GREEDY)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
        use = m.content[0]
        assert valid(use.input) if use.name == "Pick" else (use.name, use.input) == ("Done", {})


def test_claude_code_sessions_share_their_prefix(served) -> None:
    """Two sessions differ in the billing header only: the second is served from cache
    from token 0 (the header is dropped before rendering)."""
    breaks = metric(served.url, "deepinfer_prefix_breaks_total")
    first = claude_code_turn(served.url, "5b7c1d2e-aaaa-4000-8000-000000000001")
    second = claude_code_turn(served.url, "9e8f7a6b-bbbb-4000-8000-000000000002")
    u1, u2 = first["usage"], second["usage"]
    n = u1["input_tokens"] + u1["cache_creation_input_tokens"] + u1["cache_read_input_tokens"]
    assert n > 1000
    assert u2["cache_read_input_tokens"] == (n - 1) // 16 * 16
    assert u2["output_tokens"] <= MAX_OUTPUT  # max_tokens 128000, capped by the server
    assert second["stop_reason"] == "end_turn"  # the server's cap ends the turn
    assert metric(served.url, "deepinfer_prefix_breaks_total") == breaks


def test_agent_conversation_keeps_its_prefix(served) -> None:
    """Each request = the previous one + the assistant's output + a tool_result: no
    prefix break, and everything but the new turn is read from cache."""
    session = "c0ffee00-cccc-4000-8000-000000000003"
    breaks = metric(served.url, "deepinfer_prefix_breaks_total")
    messages: list[dict[str, Any]] = [first_user_turn("fix the failing test")]
    previous_total = 0
    for step in range(3):
        turn = claude_code_turn(served.url, session, messages)
        u = turn["usage"]
        total = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
        if step:
            assert u["cache_read_input_tokens"] >= (previous_total - 1) // 16 * 16, (step, u)
        previous_total = total + u["output_tokens"]
        tool_id = f"toolu_{step:02d}"
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": turn["text"]},
                {"type": "tool_use", "id": tool_id, "name": "Bash",
                 "input": {"command": f"pytest -x tests/test_{step}.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id,
                 "content": f"FAILED tests/test_{step}.py::test_x - AssertionError",
                 "cache_control": {"type": "ephemeral"}}]},
        ]
    assert metric(served.url, "deepinfer_prefix_breaks_total") == breaks


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


BAD_INPUT = {  # name: (body maker, status, error type)
    "malformed_json": (lambda: b"{not json", 400, "invalid_request_error"),
    "wrong_type": (lambda: _body(max_tokens="x"), 400, "invalid_request_error"),
    "empty_messages": (lambda: _body(messages=[]), 400, "invalid_request_error"),
    "unknown_role": (lambda: _body(messages=[{"role": "wizard", "content": "hi"}]), 400,
                     "invalid_request_error"),
    "oversize_body": (lambda: _body(messages=[{"role": "user", "content": "x" * (33 << 20)}]),
                      413, "request_too_large"),
    "prompt_too_long": (lambda: _body(messages=[{"role": "user", "content": "hello " * 9000}]),
                        400, "invalid_request_error"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gets_its_error_and_the_engine_keeps_serving(served, claude, case) -> None:
    make, status, kind = BAD_INPUT[case]
    r = httpx.post(f"{served.url}/v1/messages", content=make(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:500]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    m = claude.messages.create(model="tiny", max_tokens=2,
                               messages=[{"role": "user", "content": "ok?"}])
    assert m.usage.output_tokens >= 1


def test_client_leaving_mid_stream_aborts_and_frees_its_blocks(served) -> None:
    body = {"model": "tiny", "max_tokens": MAX_OUTPUT, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story. " * 20}]}
    with httpx.stream("POST", f"{served.url}/v1/messages", json=body, timeout=300) as r:
        assert r.status_code == 200
        msg_id = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "message_start":
                    msg_id = data["message"]["id"]
                if data["type"] == "content_block_delta":
                    break  # leave after the first text
    assert msg_id is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = metric(served.url, "deepinfer_num_requests_running")
        used = metric(served.url, 'deepinfer_kv_blocks{state="used",tier="device"}')
        if running == 0 and used == 0:
            break
        time.sleep(0.2)
    assert (running, used) == (0, 0)
    done = [json.loads(line) for line in served.log().splitlines()
            if msg_id in line and '"request_done"' in line]
    assert done and done[0]["finish_reason"] == "abort", done
    assert done[0]["output_tokens"] < MAX_OUTPUT
    # Others are unaffected.
    r = httpx.post(f"{served.url}/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "ok?"}]})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
