"""POST /v1/responses on scripted engine outputs, through the official `openai` SDK and
as Codex sends it: output items and usage, the stream's events, tool calls (namespaced
ones too) out and back in with the prefix kept, reasoning items, item ids kept out of
the prompt (the render endpoint), and errors before and after the stream starts."""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from orchestrator.shim.options import ShimOptions
from orchestrator.shim.server import build_app
from tests.orchestrator.claude_code_body import png
from tests.orchestrator.codex_body import codex_request, first_turn
from tests.orchestrator.fuzz_requests import API_KEY, MAX_REQUEST_BYTES, responses_request
from tests.orchestrator.scripted_engine import ScriptedEngine

CALL = '<tool_call>\n{"name": "codex_apps.fetch", "arguments": {"scope": "repo"}}\n</tool_call>'


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=8192)


def app_client(engine, tokenizer, template, **options: Any) -> TestClient:
    app = build_app(engine, tokenizer, model_name="tiny", chat_template=template,
                    options=ShimOptions(**options))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    with app_client(engine, tiny_tokenizer, tiny_template) as c:
        yield c


@pytest.fixture
def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                         max_retries=0)


def events(r: httpx.Response) -> list[dict[str, Any]]:
    """The stream's events, each checked to name its type on its `event:` line."""
    out, kind = [], None
    for line in r.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == kind, (kind, event)
            out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def post_stream(client: TestClient, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/responses", json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        return events(r)


def test_create_and_stream_with_the_sdk(sdk, engine) -> None:
    engine.script("Hello there.", num_device_cached=16)
    r = sdk.responses.create(model="m", instructions="Be brief.", input="hi")
    assert (r.status, r.output_text, r.object) == ("completed", "Hello there.", "response")
    assert r.id.startswith("resp_") and r.output[0].type == "message"
    prompt = engine.requests[0].prompt_token_ids
    assert r.usage.input_tokens == len(prompt) and r.usage.input_tokens_details.cached_tokens == 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert engine.requests[0].max_tokens == 8192 - len(prompt)  # no max_output_tokens: the room
    engine.script("Hello there.")
    with sdk.responses.stream(model="m", instructions="Be brief.", input="hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == "Hello there." and final.usage.output_tokens > 0
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    engine.script("Hello there.")
    chunks = list(sdk.responses.create(model="m", input="hi", stream=True))
    deltas = "".join(c.delta for c in chunks if c.type == "response.output_text.delta")
    assert deltas == "Hello there." and chunks[-1].response.id == chunks[0].response.id


def test_codex_turns_call_a_namespaced_tool_and_keep_the_prefix(client, engine) -> None:
    """A call to a namespaced function comes back as {name, namespace} with a fresh
    call_id; Codex sends the items back as they came (ids included) with the call's
    output, and the next prompt extends the previous prompt and output token for token."""
    body, headers = codex_request("codex-session-1")
    engine.script("Let me look.\n" + CALL)
    evs = post_stream(client, body, headers)
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["message", "function_call"]
    call = done[1]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == (
        "fetch", "codex_apps", {"scope": "repo"})
    assert call["call_id"].startswith("call_")
    args = [e for e in evs if e["type"].startswith("response.function_call_arguments")]
    assert [a["type"] for a in args] == ["response.function_call_arguments.delta",
                                        "response.function_call_arguments.done"]
    assert args[0]["delta"] == args[1]["arguments"] == call["arguments"]
    completed = evs[-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["output"] == done
    usage = completed["response"]["usage"]
    assert usage["input_tokens"] == len(engine.requests[0].prompt_token_ids)
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}

    body["input"] = [*body["input"], *done, {"type": "function_call_output", "id": "x",
                                             "call_id": call["call_id"], "output": "a.py"}]
    engine.script("Done.")
    post_stream(client, body, headers)
    first, second = engine.requests
    before = first.prompt_token_ids + engine_output(engine, "Let me look.\n" + CALL)
    assert second.prompt_token_ids[:len(before)] == before
    assert second.session_id == first.session_id == "gpt-5-codex|codex-session-1"
    metrics = client.get("/metrics").text
    assert ('deepinfer_client_session_requests_total{api="responses",'
            'source="prompt_cache_key"} 2.0') in metrics
    assert "deepinfer_prefix_breaks_total 0.0" in metrics


def engine_output(engine: ScriptedEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False).ids + [3]


def test_forced_call_without_parallel_calls(sdk, engine) -> None:
    """A named function (a namespaced one too): the prompt ends with the start of that
    call, and without parallel calls the answer ends after it."""
    body, _ = codex_request("s", stream=False)
    second = '\n<tool_call>\n{"name": "update_plan", "arguments": {}}\n</tool_call>'
    for choice, name, namespace in (
            ({"type": "function", "name": "exec_command"}, "exec_command", None),
            ({"type": "function", "name": "fetch", "namespace": "codex_apps"}, "fetch",
             "codex_apps")):
        engine.script('{"cmd": "ls"}}\n</tool_call>' + second)
        r = sdk.responses.create(model="m", input=body["input"], tools=body["tools"],
                                 tool_choice=choice, parallel_tool_calls=False,
                                 extra_body={"client_metadata": {"originator": "codex_exec"}})
        assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
        call = r.output[0]
        assert (call.name, call.namespace, call.arguments) == (name, namespace, '{"cmd": "ls"}')
        assert engine.requests[-1].grammar is not None


def test_item_ids_never_reach_the_prompt(client, engine) -> None:
    """Two sessions whose first requests differ only in item ids (and extra fields) render
    to the same token ids, which are what the engine is sent to prefill."""
    rendered = []
    for session in ("s1", "s2"):
        body, headers = codex_request(session)
        body["stream"] = False
        body["input"] = [{**item, "status": "completed", "x_new": session}
                         for item in body["input"]]
        r = client.post("/v1/responses/render", json=body, headers=headers)
        assert r.status_code == 200, r.text
        rendered.append(r.json()["token_ids"])
        engine.script("ok")
        assert client.post("/v1/responses", json=body, headers=headers).status_code == 200
        assert engine.requests[-1].prompt_token_ids == rendered[-1]
    assert rendered[0] == rendered[1]
    assert codex_request("s1")[0]["input"][0]["id"] != codex_request("s2")[0]["input"][0]["id"]


def test_reasoning_items(engine, tiny_tokenizer, tiny_template) -> None:
    with app_client(engine, tiny_tokenizer, tiny_template, reasoning_parser="think") as client:
        engine.script("<think>Check the tests.</think>All good.")
        evs = post_stream(client, {"model": "m", "input": first_turn("hi"), "stream": True})
        kinds = [e["type"] for e in evs]
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
        output = evs[-1]["response"]["output"]
        assert [o["type"] for o in output] == ["reasoning", "message"]
        assert output[0]["content"] == [{"type": "reasoning_text", "text": "Check the tests."}]
        assert output[1]["content"][0]["text"] == "All good."
        engine.script("ok")
        r = client.post("/v1/responses", json={"model": "m", "input": [
            *first_turn("hi"), *output, {"role": "user", "content": "and?"}]})
        assert r.status_code == 200, r.text


def test_length_cut_is_incomplete(client, engine) -> None:
    engine.script("a b c d e f g h")
    evs = post_stream(client, {"model": "m", "input": "hi", "max_output_tokens": 3,
                               "stream": True})
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_server_cap_completes_the_turn(engine, tiny_tokenizer, tiny_template) -> None:
    with app_client(engine, tiny_tokenizer, tiny_template, max_output_tokens=3) as client:
        engine.script("a b c d e f g h")
        r = client.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.json()["status"] == "completed" and r.json()["usage"]["output_tokens"] == 3


def test_errors_before_the_stream_are_openai_json(client, engine) -> None:
    engine.script("x", error_type="overloaded")
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "try again in 1s" in r.json()["error"]["message"]
    r = client.post("/v1/responses", json={"model": "m", "input": "hello " * 9000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("error_type", "code", "words"), [
    ("overloaded", "rate_limit_exceeded", "try again in 1s"),
    ("internal", "server_error", "boom"),
])
def test_errors_after_the_stream_started_are_response_failed(client, engine, error_type, code,
                                                             words) -> None:
    engine.script("a b c d e f", error_type=error_type, error_after=3)
    evs = post_stream(client, {"model": "m", "input": "hi", "stream": True})
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.failed"
    error = evs[-1]["response"]["error"]
    assert error["code"] == code and words in error["message"]
    assert evs[-1]["response"]["id"] == evs[0]["response"]["id"]


@pytest.mark.parametrize("input_items", [
    [{"type": "web_search_call", "id": "ws_1"}],  # an unknown item type
    [{"type": "function_call_output", "call_id": "call_x", "output": "?"}],  # no such call
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}],  # not JSON
    [{"role": "user", "content": 5}],  # a wrong type
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_a_400_in_openai_shape(sdk, input_items, stream) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="m", input=[{"role": "user", "content": "hi"}, *input_items],
                             stream=stream)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"]


def test_malformed_body_and_stateful_fields(client) -> None:
    r = client.post("/v1/responses", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/responses", json={"model": "m", "input": "hi",
                                           "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert client.get("/v1/responses/resp_1").status_code in (404, 405)


def test_fuzzed_bodies_get_an_answer_or_a_400_never_a_500(engine, tiny_tokenizer,
                                                           tiny_template) -> None:
    """Codex-like bodies with fields deleted, retyped or raw (fuzz_requests): each is
    answered (a response, or a stream that ends in response.completed / incomplete) or
    refused in OpenAI's error shape, never with a 500."""
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    api_key=API_KEY, options=ShimOptions(max_request_bytes=MAX_REQUEST_BYTES))
    answers: Counter[int] = Counter()

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=responses_request())
    def answer(req) -> None:
        r = client.post(req.path, content=req.body, headers=req.headers)
        answers[r.status_code] += 1
        assert r.status_code < 500, f"{req!r}: {r.status_code} {r.text[:1000]}"
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
            assert kinds[0] == "response.created", kinds
            assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        else:
            assert r.json()["object"] == "response"

    with TestClient(app, raise_server_exceptions=False) as client:
        answer()
    print("answers:", dict(answers))
    assert answers[200] >= 3 and answers[400] >= 30, answers


def test_images_become_placeholders_and_limits_hold(engine, tiny_tokenizer,
                                                    tiny_template) -> None:
    """An input_image (in a message or a call's output) is a placeholder, as on the chat
    API; --on-image reject refuses it; --max-messages counts input items."""
    image = "data:image/png;base64," + base64.b64encode(png(2, 2)).decode()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "look"},
                                          {"type": "input_image", "image_url": image}]}]
    with app_client(engine, tiny_tokenizer, tiny_template) as client:
        r = client.post("/v1/responses/render", json={"model": "m", "input": items})
        prompt = tiny_tokenizer.decode(r.json()["token_ids"], skip_special_tokens=False)
        assert "look\n[image: image/png, " in prompt
    with app_client(engine, tiny_tokenizer, tiny_template, on_image="reject",
                    max_messages=2) as client:
        r = client.post("/v1/responses", json={"model": "m", "input": items})
        assert r.status_code == 400 and "--on-image reject" in r.json()["error"]["message"]
        r = client.post("/v1/responses", json={"model": "m", "input": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert "at most 2" in r.json()["error"]["message"]
