"""Thousands of malformed and adversarial requests against a real 4-rank engine.

Every answer must be a 4xx in the shape of its API (Anthropic: {"type": "error",
"error": {"type", "message"}}; OpenAI: {"error": {"message", "type", "param", "code"}})
or, when the fuzzer happened to write a valid request, a well-formed 200: never a 5xx,
never a dropped connection. Afterwards the engine still answers a greedy completion
exactly as before, holds no referenced blocks, and its ranks agree.

Strategies are in fuzz_requests.py. Each example sends a batch of requests at once (the
engine batches the valid ones, which keeps them cheap, and concurrency is part of the
attack surface): about 2,300 requests in all. Shrinking is off: the engine is shared
state, and the first failing request is the one worth reading. A failure found once
stays here as an @example (the regressions below).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.orchestrator.fuzz_requests import (
    API_KEY,
    MAX_REQUEST_BYTES,
    Request,
    anthropic_request,
    chat_request,
    completion_request,
    raw_request,
)
from tests.tools.engine import Engine

pytestmark = pytest.mark.slow
BATCH = 4  # requests sent at once per example
AUTH = {"x-api-key": API_KEY}
# Long enough for full blocks: the second run reads them from the prefix cache.
REFERENCE = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 6,
             "max_tokens": 4, "temperature": 0}
# (API, status) of every answer: the last test checks that each API served some requests
# (the fuzzer reaches the engine, not only the validation).
ANSWERS: Counter[tuple[str, int]] = Counter()
ANTHROPIC_ERRORS = {"invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                    "overloaded_error"}


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def engine(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("fuzz")
    key_file = home / "api-key"
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    # Small limits so the fuzzer reaches them, and so valid requests stay cheap.
    eng = Engine(default_model, home / "run", "--api-key-file", str(key_file),
                 "--max-model-len", "512", "--max-output-tokens", "4",
                 "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-messages", "3",
                 "--max-tools", "2", "--reasoning-parser", "qwen3")  # thinking spans too
    yield eng
    assert eng.stop() == 0, eng.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def http(engine: Engine):
    with httpx.Client(base_url=engine.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http: httpx.Client) -> list[int]:
    """A greedy completion made before any fuzzing."""
    r = http.post("/v1/completions", json=REFERENCE, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


# --- what every answer must look like -------------------------------------------------------


def batches(requests: st.SearchStrategy[Request]) -> st.SearchStrategy[list[Request]]:
    return st.lists(requests, min_size=BATCH, max_size=BATCH)


def send_all(http: httpx.Client, reqs: list[Request]) -> None:
    """Send `reqs` at once (the engine batches the valid ones: cheaper, and concurrent
    requests are part of the attack surface) and check every answer."""
    with ThreadPoolExecutor(len(reqs)) as pool:
        answers = list(pool.map(lambda req: send(http, req), reqs))
    for req, answer in zip(reqs, answers):
        try:
            check(req, answer)
        except AssertionError as exc:
            raise AssertionError(f"{req!r}:\n{exc}") from None


def send(http: httpx.Client, req: Request) -> httpx.Response:
    """The answer, read whole; a dropped connection raises here and fails the test."""
    return http.request(req.method, req.path, content=req.body, headers=req.headers)


def check(req: Request, r: httpx.Response) -> None:
    ANSWERS[req.path.split("?")[0], r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:2000]}"
    if r.status_code == 200:
        check_success(req, r)
    else:
        check_error(req, r)


def check_error(req: Request, r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, r.status_code
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    if req.path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] in ANTHROPIC_ERRORS, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                                 "code"}, body
        assert isinstance(body["error"]["type"], str), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def check_success(req: Request, r: httpx.Response) -> None:
    if r.headers["content-type"].startswith("text/event-stream"):
        if req.path.startswith("/v1/messages"):
            check_anthropic_stream(r.text)
        else:
            check_openai_stream(r.text)
        return
    body = r.json()
    if req.path.startswith("/v1/messages/count_tokens"):
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0, body
    elif req.path.startswith("/v1/messages"):
        assert body["type"] == "message" and isinstance(body["content"], list), body
        assert body["usage"]["output_tokens"] >= 1, body
    elif req.path == "/v1/chat/completions":
        assert body["object"] == "chat.completion" and len(body["choices"]) == 1, body
    elif req.path == "/v1/completions":
        assert body["object"] == "text_completion" and len(body["choices"]) == 1, body


def check_anthropic_stream(text: str) -> None:
    kinds = []
    for block in text.strip().split("\n\n"):
        event, data = block.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: "), block
        kinds.append(event[7:])
        assert json.loads(data[6:])["type"] == kinds[-1]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "error" not in kinds, text


def check_openai_stream(text: str) -> None:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text[-500:]
    for chunk in map(json.loads, data[:-1]):
        assert "error" not in chunk, chunk


# --- the fuzzers: the reference goes first, the checks of the engine's state last ----------


# --- regressions: requests the fuzzer found answered with a 500 --------------------------------

def post(path: str, body: bytes) -> Request:
    return Request("POST", path, body, {"content-type": "application/json", **AUTH})


# Nesting past the recursion limit: json.loads raised RecursionError.
DEEP = post("/v1/messages", b'{"max_tokens": 1, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}")
# A lone surrogate escape is valid JSON but not Unicode: the tokenizer raised TypeError.
LONE_SURROGATE = post("/v1/messages", b'{"max_tokens": 1, "messages": [{"role": "user", '
                      b'"content": "a\\ud800b"}]}')
# Integers past 64 bits passed validation, then failed to encode (msgpack OverflowError).
HUGE_SEED = post("/v1/completions", b'{"prompt": "<|im_end|>", "max_tokens": 2, "seed": -1'
                 + b"0" * 30 + b"}")
HUGE_TOP_K = post("/v1/messages", b'{"max_tokens": 1, "top_k": 1' + b"0" * 30
                  + b', "messages": [{"role": "user", "content": "hi"}]}')
# A top_p of 5e-324 is 0 in float32, and a temperature of 1e-300 overflows logits / t:
# either made every rank fail the step, which stopped the engine for everyone.
TINY_TOP_P = post("/v1/messages", b'{"max_tokens": 1, "top_p": 5e-324, '
                  b'"messages": [{"role": "user", "content": ""}]}')
TINY_TEMPERATURE = post("/v1/chat/completions", b'{"max_tokens": 2, "temperature": 1e-300, '
                        b'"messages": [{"role": "user", "content": "hi"}]}')
# Tool-call arguments are a JSON string parsed by the shim: too deep raised RecursionError.
DEEP_ARGUMENTS = post("/v1/chat/completions", json.dumps({
    "max_tokens": 1, "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]}).encode())
# A response_format that is not an object (here a list) raised AttributeError.
LIST_RESPONSE_FORMAT = post("/v1/chat/completions", b'{"max_tokens": 1, "response_format": '
                            b'["json_object"], "messages": [{"role": "user", "content": "hi"}]}')
# Found by a read-only audit: each raised past validation (TypeError, OverflowError, or
# llguidance's ValueError on a schema holding an integer past 64 bits).
LIST_ROLE = post("/v1/chat/completions", b'{"max_tokens": 1, "messages": [{"role": []}]}')
BIG = b"1" + b"0" * 320  # past a float's range
HUGE_TEMPERATURE = post("/v1/chat/completions", b'{"max_tokens": 1, "temperature": ' + BIG
                        + b', "messages": [{"role": "user", "content": "hi"}]}')
HUGE_TOP_P = post("/v1/completions", b'{"prompt": [1], "max_tokens": 1, "top_p": ' + BIG + b"}")
LIST_CHOICE_TYPE = post("/v1/messages", b'{"max_tokens": 1, "tool_choice": {"type": []}, '
                        b'"messages": [{"role": "user", "content": "hi"}]}')
HUGE_SCHEMA_INT = post("/v1/messages", b'{"max_tokens": 1, "output_format": {"type": '
                       b'"json_schema", "schema": {"default": 18446744073709551616}}, '
                       b'"messages": [{"role": "user", "content": "hi"}]}')
LIST_DESCRIPTION = post("/v1/chat/completions", b'{"max_tokens": 1, "tools": [{"type": '
                        b'"function", "function": {"name": "f", "description": ["d"]}}], '
                        b'"messages": [{"role": "user", "content": "hi"}]}')
HUGE_CHAT_SEED = post("/v1/chat/completions", b'{"max_tokens": 1, "seed": 18446744073709551616, '
                      b'"messages": [{"role": "user", "content": "hi"}]}')


def test_reference_before_fuzzing(reference: list[int]) -> None:
    assert len(reference) == 4


@fuzz(max_examples=150)
@given(reqs=batches(anthropic_request()))
@example(reqs=[DEEP, LONE_SURROGATE, HUGE_TOP_K, TINY_TOP_P])
@example(reqs=[LIST_CHOICE_TYPE, HUGE_SCHEMA_INT])
def test_fuzz_anthropic_messages(http: httpx.Client, reqs: list[Request]) -> None:
    send_all(http, reqs)


@fuzz(max_examples=150)
@given(reqs=batches(chat_request()))
@example(reqs=[HUGE_CHAT_SEED, TINY_TEMPERATURE, DEEP_ARGUMENTS, LIST_RESPONSE_FORMAT])
@example(reqs=[LIST_ROLE, HUGE_TEMPERATURE, LIST_DESCRIPTION])
def test_fuzz_openai_chat(http: httpx.Client, reqs: list[Request]) -> None:
    send_all(http, reqs)


@fuzz(max_examples=125)
@given(reqs=batches(completion_request()))
@example(reqs=[HUGE_SEED, HUGE_TOP_P])
def test_fuzz_openai_completions(http: httpx.Client, reqs: list[Request]) -> None:
    send_all(http, reqs)


@fuzz(max_examples=150)
@given(reqs=batches(raw_request()))
def test_fuzz_raw_bodies_methods_and_paths(http: httpx.Client, reqs: list[Request]) -> None:
    send_all(http, reqs)


def idle_view(engine: Engine) -> dict | None:
    status, view = engine.inspect_json("ranks")
    assert status == 0
    procs = [view["scheduler"], *view["ranks"]]
    same_step = len({p["step"] for p in procs}) == 1
    return view if same_step and all(p["state"] == "idle" for p in procs) else None


def test_the_engine_is_intact_after_fuzzing(engine: Engine, http: httpx.Client,
                                            reference: list[int]) -> None:
    print("answers:", dict(sorted(ANSWERS.items())))
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/completions"):
        assert ANSWERS[path, 200] >= 3, (path, ANSWERS)  # about 20 or more each
    r = http.post("/v1/completions", json=REFERENCE, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    view = engine.wait_for("an idle engine", lambda: idle_view(engine))
    for proc in [view["scheduler"], *view["ranks"]]:
        assert proc.get("seqs", []) == []
        for tier, usage in proc["usage"].items():
            assert usage["used"] == 0, (tier, usage)  # no block referenced by anyone
    metrics = http.get("/metrics", headers=AUTH).text
    assert 'deepinfer_kv_blocks{state="used",tier="device"} 0.0' in metrics, metrics
    status, result = engine.inspect_json("check")
    assert status == 0 and result["agree"], result
