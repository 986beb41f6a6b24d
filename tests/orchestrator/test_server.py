"""The shim's HTTP error paths: every request it can tell is bad is refused with an
OpenAI-shaped error and never reaches the engine.

The engine here is a stand-in that only answers start() and fails the test if asked
to generate: generation is tested end to end against the real scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from orchestrator.shim.server import build_app, parse_args, requests_address
from wire.client import GenerateRequest, RequestOutput
from wire.lifecycle import EngineInfo, EngineLimits

MAX_LEN = 64


class StandInEngine:
    """Answers start() like the scheduler would; refuses to generate."""

    def __init__(self, vocab_size: int, *, generate_error: Exception | None = None) -> None:
        self._info = EngineInfo("tiny", 16, 1, EngineLimits(
            vocab_size=vocab_size, max_model_len=MAX_LEN, eos_token_ids=(0,),
            num_device_blocks=8, num_host_blocks=0))
        self.connected = False
        self.generate_error = generate_error
        self.requests: list[GenerateRequest] = []

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> EngineInfo:
        self.connected = True
        return self._info

    async def close(self) -> None:
        self.connected = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if self.generate_error is not None:
            raise self.generate_error
        raise AssertionError(f"a bad request reached the engine: {request}")
        yield  # pragma: no cover  (makes this an async generator)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        pass


@pytest.fixture
def engine(tokenizer: Tokenizer) -> StandInEngine:
    return StandInEngine(tokenizer.get_vocab_size())


@pytest.fixture
def client(engine: StandInEngine, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = build_app(engine, tokenizer, model_name="tiny-served")
    with TestClient(app) as c:
        yield c
    assert engine.requests == [], "a request the shim could refuse reached the engine"


def assert_openai_error(r: Any, status: int, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body  # never a framework's {"detail": ...}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"]
    return err


def test_health_and_models(client: TestClient, engine: StandInEngine) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [("tiny-served", "model")]
    engine.connected = False
    assert client.get("/health").status_code == 503


def test_several_served_names_are_all_listed(engine: StandInEngine,
                                             tokenizer: Tokenizer) -> None:
    """A router (SMG) routes a model name only to replicas listing it: Claude Code's
    default name must be listed to reach the engine through one."""
    app = build_app(engine, tokenizer, model_name=["tiny-llama", "claude-sonnet-4-5"])
    with TestClient(app) as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-llama", "claude-sonnet-4-5"]
        assert (models["first_id"], models["last_id"]) == ("tiny-llama", "claude-sonnet-4-5")
        assert c.get("/v1/models/claude-sonnet-4-5").json()["id"] == "claude-sonnet-4-5"
        err = assert_openai_error(c.get("/v1/models/gpt-4"), 404, "not_found_error")
        assert "'tiny-llama', 'claude-sonnet-4-5'" in err["message"]


def test_invalid_json(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "hi",', headers={
        "content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(r, 400)["message"]
    assert_openai_error(client.post("/v1/completions", content=b"\xff\xfe"), 400)


def test_body_must_be_an_object(client: TestClient) -> None:
    assert_openai_error(client.post("/v1/completions", json=["hi"]), 400)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "n": 3}, "n"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ],
)
def test_bad_requests(client: TestClient, body: dict, param: str) -> None:
    variants = [body] if "stream" in body else [body, {**body, "stream": True}]
    for json_body in variants:
        err = assert_openai_error(client.post("/v1/completions", json=json_body), 400)
        assert err["param"] == param


def test_prompt_too_long_string(client: TestClient, tokenizer: Tokenizer) -> None:
    text = "hello there " * 40
    n = len(tokenizer.encode(text).ids)
    assert n > MAX_LEN
    err = assert_openai_error(client.post("/v1/completions", json={"prompt": text}), 400)
    assert err["message"].startswith(
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{n} tokens in the prompt."
    )


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_openai_error(client.get("/v1/nothing"), 404, "not_found_error")
    assert_openai_error(client.get("/v1/completions"), 405)


def test_api_key(engine: StandInEngine, tokenizer: Tokenizer) -> None:
    app = build_app(engine, tokenizer, model_name="m", api_key="sekret")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200  # probes need no key
        assert_openai_error(c.get("/v1/models"), 401, "authentication_error")
        bad = {"authorization": "Bearer nope"}
        assert_openai_error(c.post("/v1/completions", json={}, headers=bad), 401,
                            "authentication_error")
        good = {"authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        # Past auth, validation still refuses before the engine.
        assert_openai_error(c.post("/v1/completions", json={}, headers=good), 400)
    assert engine.requests == []


def test_max_model_len_flag_lowers_the_limit(engine: StandInEngine, tokenizer: Tokenizer) -> None:
    app = build_app(engine, tokenizer, model_name="m", max_model_len=4)
    with TestClient(app) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 4
        err = assert_openai_error(c.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5]}),
                                  400)
        assert "maximum context length is 4 tokens" in err["message"]


ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-served", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages", {"max_tokens": 4, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_engine_gone_is_503_with_retry_after(client: TestClient, engine: StandInEngine,
                                             method: str, path: str, body: Any) -> None:
    """The engine failed or is restarting: every endpoint says so with a retry-after
    (never a 500), each in its API's shape; /health too, /metrics still answers."""
    engine.connected = False
    r = client.request(method, path, json=body)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    if path.startswith("/v1/messages"):
        assert r.json()["error"]["type"] == "api_error"
    else:
        assert_openai_error(r, 503, "service_unavailable")
    health = client.get("/health")
    assert health.status_code == 503 and health.headers["retry-after"]
    assert client.get("/metrics").status_code == 200
    # counting tokens needs only the tokenizer (and a chat template, which this app
    # lacks: a 400), not the engine: never a 503
    count = client.post("/v1/messages/count_tokens",
                        json={"messages": [{"role": "user", "content": "hi"}]})
    assert count.status_code != 503, count.text


@pytest.mark.parametrize("stream", [False, True])
def test_engine_lost_after_the_check_is_503(tokenizer: Tokenizer, stream: bool) -> None:
    """Gone between the endpoint's check and the send: still a 503, not a 500."""
    from orchestrator.shim.engine_client import EngineUnavailableError

    engine = StandInEngine(tokenizer.get_vocab_size(),
                           generate_error=EngineUnavailableError("the engine shut down"))
    with TestClient(build_app(engine, tokenizer, model_name="m")) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert_openai_error(r, 503, "service_unavailable")
        assert r.headers["retry-after"] == "5"


def test_internal_error_is_500_in_openai_shape(tokenizer: Tokenizer) -> None:
    engine = StandInEngine(tokenizer.get_vocab_size(), generate_error=RuntimeError("boom"))
    app = build_app(engine, tokenizer, model_name="m")
    with TestClient(app, raise_server_exceptions=False) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            assert_openai_error(r, 500, "internal_error")


def test_cli_defaults() -> None:
    args = parse_args(["--run-dir", "/tmp/r", "--model", "/m/tiny"])
    assert (args.host, args.port, args.api_key, args.max_model_len) == (
        "127.0.0.1", 8000, None, 0)


def test_requests_address(tmp_path: Any) -> None:
    assert requests_address(tmp_path) == f"ipc://{tmp_path.resolve()}/requests.sock"
    (tmp_path / "addresses.json").write_text('{"requests": "tcp://10.0.0.1:9002"}')
    assert requests_address(tmp_path) == "tcp://10.0.0.1:9002"


def test_unavailable_shim_answers_503_in_each_api_shape(client: TestClient) -> None:
    """While the start-up self-check (or a restart) runs, traffic is refused with a
    retry-after, /health says why, and only the self-check's own requests pass."""
    from orchestrator.shim.admission import SELF_CHECK_HEADER

    state = client.app.state.shim
    state.unavailable, state.self_check_secret = "the start-up self-check is running", "s3cret"
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["reason"] == state.unavailable
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert_openai_error(r, 503, "service_unavailable")
    assert r.headers["retry-after"] == str(state.retry_after_s)
    r = client.post("/v1/messages", json={"max_tokens": 4, "messages": []})
    assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
    assert r.headers["retry-after"]
    assert client.get("/v1/models").status_code == 503
    assert client.get("/v1/models", headers={SELF_CHECK_HEADER: "wrong"}).status_code == 503
    assert client.get("/v1/models", headers={SELF_CHECK_HEADER: "s3cret"}).status_code == 200
    assert client.get("/metrics").status_code == 200
    state.unavailable = None
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["block_size"] == 16
