"""The render endpoints give the token ids the engine is sent to prefill, token for token:
each body is rendered, then sent for real, and the ids the engine received (the
GenerateRequest's prompt, what the scheduler prefills) must equal the render's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from structlog.testing import capture_logs

from orchestrator.shim.options import ShimOptions
from orchestrator.shim.server import build_app
from tests.orchestrator.claude_code_body import claude_code_request
from tests.orchestrator.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=8192)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def render_then_prefill(client: TestClient, engine: ScriptedEngine, path: str,
                        body: dict[str, Any], headers: dict[str, str] | None = None,
                        answer: str = "ok") -> list[int]:
    """The render's ids, checked equal to what the engine then got for the same body."""
    num_before = len(engine.requests)
    r = client.post(f"{path}/render", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    rendered = r.json()["token_ids"]
    assert len(engine.requests) == num_before, "a render reached the engine"
    engine.script(answer)
    r = client.post(path, json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == rendered
    return rendered


@pytest.mark.parametrize("extra", [
    {},
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "required"},  # the forced call opens the prompt
])
def test_openai_chat(client, engine, extra) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        **extra}
    ids = render_then_prefill(client, engine, "/v1/chat/completions", body)
    assert ids


def test_openai_completions(client, engine, tiny_tokenizer) -> None:
    ids = render_then_prefill(client, engine, "/v1/completions",
                              {"model": "m", "prompt": "def add(a, b):", "max_tokens": 4})
    assert ids == tiny_tokenizer.encode("def add(a, b):").ids
    assert render_then_prefill(client, engine, "/v1/completions",
                               {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}) == [5, 6, 7]


def test_claude_code_sessions_render_as_they_prefill(client, engine) -> None:
    """Recorded Claude Code bodies: the billing header (its suffix differs per session) is
    stripped, thinking is rendered, and a later turn reuses the session's ids."""
    sessions = ["3f2a9c1e-0000-4000-8000-000000000001", "b71d04aa-0000-4000-8000-000000000002"]
    firsts = []
    for session in sessions:
        body, headers = claude_code_request(session, stream=False)
        firsts.append(render_then_prefill(client, engine, "/v1/messages", body, headers,
                                          answer="Hello! How can I help?"))
        messages = [*body["messages"],
                    {"role": "assistant", "content": [
                        {"type": "text", "text": "Hello! How can I help?"}]},
                    {"role": "user", "content": [{"type": "text", "text": "list the files"}]}]
        body2, headers2 = claude_code_request(session, messages, stream=False)
        second = render_then_prefill(client, engine, "/v1/messages", body2, headers2)
        assert second[:len(firsts[-1])] == firsts[-1]  # the turn extends the last prompt
    assert firsts[0] == firsts[1]  # sessions share the prefix: no billing header in it


def test_the_billing_header_is_dropped_counted_and_kept_on_request(
        client, engine, tiny_tokenizer, tiny_template) -> None:
    """Leaving the header out changes the prompt: each time is logged and counted, and
    `--billing-header keep` renders it, first in the system prompt, as the client sent it
    (and /v1/messages/count_tokens counts the same prompt)."""
    body, headers = claude_code_request("3f2a9c1e-0000-4000-8000-000000000001", stream=False)
    header = body["system"][0]["text"]
    assert header.startswith("x-anthropic-billing-header:")
    with capture_logs() as logs:
        dropped = render_then_prefill(client, engine, "/v1/messages", body, headers)
    # once for the render, once for the request sent
    drops = [e["dropped"] for e in logs if e["event"] == "prompt_normalised"]
    assert drops == ["billing_header"] * 2
    assert 'deepinfer_prompt_normalised_total{what="billing_header"} 2.0' in client.get(
        "/metrics").text
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    options=ShimOptions(billing_header="keep"))
    with TestClient(app, raise_server_exceptions=False) as keep:
        with capture_logs() as logs:
            kept = render_then_prefill(keep, engine, "/v1/messages", body, headers)
        assert not [e for e in logs if e["event"] == "prompt_normalised"]
        text = tiny_tokenizer.decode(kept)
        assert header in text and text.index(header) < text.index(body["system"][1]["text"])
        assert tiny_tokenizer.decode(dropped) == text.replace(header + "\n", "", 1)
        counted = keep.post("/v1/messages/count_tokens", json=body, headers=headers).json()
        assert counted["input_tokens"] == len(kept)
        assert 'deepinfer_prompt_normalised_total{what="billing_header"}' not in keep.get(
            "/metrics").text


def test_render_errors_are_the_apis(client, engine) -> None:
    r = client.post("/v1/messages/render", json={"model": "m", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = client.post("/v1/chat/completions/render", json={"model": "m", "messages": []})
    assert r.status_code == 400 and "error" in r.json()
    assert engine.requests == []
