"""The shim's security settings: the API key on every endpoint but /health, where the
key comes from (never a command line the launcher builds), and the request limits,
each refused in the shape of the API its path belongs to."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from orchestrator.config import ServeOptions, add_serve_arguments, build_config, secret_file_env
from orchestrator.shim.options import API_KEY_ENV, DEFAULT_MAX_HEADER_BYTES, ShimOptions
from orchestrator.shim.server import build_app, parse_args, resolve_api_key
from tests.orchestrator.test_server import StandInEngine, assert_openai_error
from wire.security import SECRET_FILE_ENV

KEY = "sekret-key-0123456789"
GOOD = {"x-api-key": KEY}
CHAT = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def app(tiny_tokenizer, tiny_template):
    engine = StandInEngine(tiny_tokenizer.get_vocab_size())
    return build_app(engine, tiny_tokenizer, model_name="tiny", api_key=KEY,
                     chat_template=tiny_template,
                     options=ShimOptions(max_tools=2, max_messages=3, max_header_bytes=2048))


@pytest.fixture
def client(app) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def assert_anthropic_error(r, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == type_
    return body["error"]["message"]


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""
    out = []
    for route in app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{model_id:path}", "tiny")
        out += [(m, path) for m in sorted(route.methods or [])]
    return out


def test_every_endpoint_but_health_needs_the_key(app, client) -> None:
    served = routes(app)
    assert ("GET", "/metrics") in served and ("POST", "/v1/messages/count_tokens") in served
    for method, path in served:
        body = CHAT if method == "POST" else None
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            r = client.request(method, path, json=body, headers=headers)
            if path == "/health":
                assert r.status_code == 200, (method, path)
            elif method == "HEAD":
                assert r.status_code == 401, (method, path)
            elif path.startswith("/v1/messages"):
                assert_anthropic_error(r, 401, "authentication_error")
            else:
                assert_openai_error(r, 401, "authentication_error")
        r = client.request(method, path, json=body, headers=GOOD)
        assert r.status_code != 401, (method, path)
    assert client.get("/", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_key_is_never_in_the_state_repr(app) -> None:
    assert KEY not in repr(app.state.shim)


def test_message_and_tool_limits_in_each_api_shape(client) -> None:
    four = [{"role": "user", "content": "hi"}] * 4
    for path in ("/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"):
        msg = assert_anthropic_error(
            client.post(path, json={**CHAT, "messages": four}, headers=GOOD), 400,
            "invalid_request_error")
        assert msg == "messages: 4 given, this server accepts at most 3"
        tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(3)]
        msg = assert_anthropic_error(
            client.post(path, json={**CHAT, "tools": tools}, headers=GOOD), 400,
            "invalid_request_error")
        assert msg == "tools: 3 given, this server accepts at most 2"
    ok = client.post("/v1/messages/count_tokens", json={**CHAT, "messages": four[:3]},
                     headers=GOOD)
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0

    r = client.post("/v1/chat/completions", json={**CHAT, "messages": four}, headers=GOOD)
    assert assert_openai_error(r, 400)["param"] == "messages"
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(3)]
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": tools}, headers=GOOD)
    assert assert_openai_error(r, 400)["param"] == "tools"


def test_header_limit_in_each_api_shape(client) -> None:
    big = {**GOOD, "x-padding": "a" * 2048}
    msg = assert_anthropic_error(client.post("/v1/messages", json=CHAT, headers=big), 431,
                                 "invalid_request_error")
    assert "larger than 2048 bytes" in msg
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT, headers=big), 431)
    assert client.get("/health", headers=big).status_code == 431
    assert client.get("/v1/models", headers={**GOOD, "x-padding": "a" * 1500}).status_code == 200


def private_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_shim_key_sources(tmp_path: Path, monkeypatch) -> None:
    base = ["--run-dir", "/tmp/r", "--model", "/m"]
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(parse_args(base)) == "from-env"
    assert API_KEY_ENV not in os.environ  # taken out: no child inherits it
    path = private_file(tmp_path, f"{KEY}\n")
    assert resolve_api_key(parse_args([*base, "--api-key-file", str(path)])) == KEY
    path.chmod(0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        resolve_api_key(parse_args([*base, "--api-key-file", str(path)]))
    with pytest.raises(SystemExit, match="not both"):
        resolve_api_key(parse_args([*base, "--api-key", "x", "--api-key-file", str(path)]))
    assert resolve_api_key(parse_args(base)) is None
    assert parse_args(base).max_header_bytes == DEFAULT_MAX_HEADER_BYTES


def serve_options(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return build_config(p.parse_args(list(argv)), world_size=1)[1]


def test_launcher_options_reach_the_shim_without_the_key(tmp_path: Path,
                                                         default_model: Path) -> None:
    path = private_file(tmp_path, KEY)
    serve = serve_options("--model", str(default_model), "--api-key-file", str(path),
                          "--max-tools", "7", "--max-messages", "9", "--max-header-bytes",
                          "4096", "--max-request-bytes", "1000")
    assert serve.api_key == KEY and KEY not in repr(serve)
    argv = serve.shim_args()
    assert KEY not in " ".join(argv)
    args = parse_args(["--run-dir", "/r", "--model", "/m", *argv])
    assert (args.max_tools, args.max_messages, args.max_header_bytes,
            args.max_request_bytes) == (7, 9, 4096, 1000)
    # every serving option reaches the shim as given to `deepinfer-run serve`
    serve = serve_options("--model", str(default_model), "--port", "9123", "--host", "::1",
                          "--served-model-name", "coder", "--max-output-tokens", "77",
                          "--tool-call-parser", "none", "--request-timeout", "30",
                          "--self-check", "--self-check-tokens", "256")
    args = parse_args(["--run-dir", "/r", "--model", "/m", *serve.shim_args()])
    assert (args.port, args.host, args.served_model_name, args.max_output_tokens,
            args.tool_call_parser, args.request_timeout, args.self_check,
            args.self_check_tokens) == (9123, "::1", ["coder"], 77, "none", 30.0, True, 256)
    assert serve_options("--model", str(default_model)).host == "127.0.0.1"
    # ... and every shim option, through its own dataclass (a flag per field)
    shim = ShimOptions(max_output_tokens=5, tool_call_parser="llama3_json",
                       reasoning_parser="qwen3", max_thinking_tokens=6, request_timeout_s=2.5,
                       max_request_bytes=99, max_tools=3, max_messages=4, max_header_bytes=5000)
    argv = ServeOptions(shim=shim).shim_args()
    assert ShimOptions.from_args(parse_args(["--run-dir", "/r", "--model", "/m", *argv])) == shim
    with pytest.raises(SystemExit, match="--max-thinking-tokens must be >= 0"):
        ShimOptions.from_args(parse_args(["--run-dir", "/r", "--model", "/m",
                                          "--max-thinking-tokens", "-1"]))
    path.chmod(0o604)
    with pytest.raises(SystemExit, match="group or others"):
        serve_options("--model", str(default_model), "--api-key-file", str(path))


def test_secret_file_is_required_for_several_nodes(tmp_path: Path) -> None:
    assert secret_file_env(None, multi_node=False) == {}
    with pytest.raises(SystemExit, match="--secret-file"):
        secret_file_env(None, multi_node=True)
    path = private_file(tmp_path, "x" * 32, 0o640)
    with pytest.raises(SystemExit, match="chmod 600"):
        secret_file_env(str(path), multi_node=True)
    path.chmod(0o600)
    assert secret_file_env(str(path), multi_node=True) == {SECRET_FILE_ENV: str(path)}
