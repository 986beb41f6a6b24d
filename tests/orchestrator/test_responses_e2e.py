"""POST /v1/responses against the real engine (`deepinfer-run serve`, tiny-llama), with the
official `openai` SDK and with bodies shaped like Codex CLI's. The model has random
weights, so the tests hold what the server promises whatever the text: every response
parses, usage adds up, a session's later turns and a new session's first request are
read from cache (item ids differ, the prompt does not), a forced call to a namespaced
tool comes back as a function_call whose output goes back in, and bad input is a 400.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.orchestrator.codex_body import codex_request
from tests.orchestrator.e2e_helpers import Served

pytestmark = pytest.mark.slow

MAX_OUTPUT = 16  # --max-output-tokens: Codex sends no max_output_tokens (random text, CPU)
BLOCK = 16


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    engine = Served(default_model, tmp_path_factory.mktemp("responses") / "run", nproc=1,
                    extra_args=["--max-output-tokens", str(MAX_OUTPUT)])
    yield engine
    assert engine.stop() == 0, engine.log()[-3000:]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=300)


def codex_turn(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed Codex-shaped request; returns the completed response."""
    with httpx.stream("POST", f"{url}/v1/responses", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in data] == list(range(len(data)))
    assert data[0]["type"] == "response.created" and data[-1]["type"] == "response.completed"
    response = data[-1]["response"]
    done = [e["item"] for e in data if e["type"] == "response.output_item.done"]
    assert response["output"] == done
    return response


def cached_floor(num_tokens: int) -> int:
    """The full blocks of a prompt before its last token: what a repeat reads from cache."""
    return (num_tokens - 1) // BLOCK * BLOCK


def test_openai_sdk_create_and_stream(client) -> None:
    kwargs = {"model": "tiny", "instructions": "You are terse.", "input": "Say something.",
              "temperature": 0}  # no max_output_tokens: the server's cap completes the turn
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and r.output[0].type == "message"
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 1 <= u.output_tokens <= MAX_OUTPUT
    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text  # greedy: the same answer
    assert final.usage.input_tokens == u.input_tokens
    assert final.usage.input_tokens_details.cached_tokens == cached_floor(u.input_tokens)
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == r.output_text
    cut = client.responses.create(**kwargs, max_output_tokens=2)  # the request's own limit
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_codex_session_forced_call_round_trip_and_cache(served) -> None:
    """Turn 1 forces a call to a namespaced tool; turn 2 sends it back with its output
    (tool_choice auto); turn 3 adds a user message. Each later turn reads all of the
    previous prompt and answer from cache; a second session whose items differ only in
    their ids reads the first request whole from cache."""
    body, headers = codex_request("codex-e2e-session-1")
    body["temperature"] = 0
    body["tool_choice"] = {"type": "function", "name": "fetch", "namespace": "codex_apps"}
    body["parallel_tool_calls"] = False
    first = codex_turn(served.url, body, headers)
    [call] = first["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "fetch",
                                                              "codex_apps")
    assert json.loads(call["arguments"])["scope"] in ("repo", "file")  # held to the schema
    previous = first["usage"]["total_tokens"]

    body.update(tool_choice="auto", parallel_tool_calls=True)
    body["input"] = [*body["input"], *first["output"], {
        "type": "function_call_output", "call_id": call["call_id"], "output": "README.md"}]
    for turn in range(2):
        response = codex_turn(served.url, body, headers)
        usage = response["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= cached_floor(previous), (
            turn, usage)
        previous = usage["total_tokens"]
        body["input"] = [*body["input"], *response["output"],
                         {"type": "message", "role": "user", "id": f"msg_u{turn}",
                          "content": [{"type": "input_text", "text": "and now?"}]}]

    other, other_headers = codex_request("codex-e2e-session-2")
    assert other["input"][0]["id"] != codex_request("x")[0]["input"][0]["id"]
    response = codex_turn(served.url, {**other, "temperature": 0, "tool_choice": "none"},
                          other_headers)
    usage = response["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == cached_floor(usage["input_tokens"])


@pytest.mark.parametrize(("input_items", "words"), [
    ([{"type": "computer_call", "id": "c"}], "unsupported input item type"),
    ([{"type": "function_call_output", "call_id": "call_nope", "output": "x"}], "call_nope"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}],
     "not valid JSON"),
])
def test_bad_input_is_a_400_and_the_engine_keeps_serving(served, client, input_items,
                                                         words) -> None:
    body = {"model": "tiny", "stream": True,
            "input": [{"role": "user", "content": "hi"}, *input_items]}
    r = httpx.post(f"{served.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    assert client.responses.create(model="tiny", input="ok?").usage.output_tokens >= 1
