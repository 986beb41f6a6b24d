"""`cache_salt` and `--cache-salt-per-api-key`: the keys file (private, well formed, errors
that never show a key), the shim accepting each tenant's keys in both APIs' headers, and
every request salted with its key's tenant, combined with (never replaced by) its own
salt; on scripted engine outputs (tests/orchestrator/test_cache_salt_e2e.py shows the
blocks are then shared, or not, in the real engine)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from orchestrator.config import add_serve_arguments, build_config
from orchestrator.shim.admission import SELF_CHECK_HEADER
from orchestrator.shim.options import ShimOptions
from orchestrator.shim.server import build_app, parse_args
from orchestrator.shim.tenants import Tenants, salted, tenant_session
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_anthropic_api import assert_error

KEY_A1, KEY_A2, KEY_B = "sk-acme-0000000000000001", "sk-acme-0000000000000002", \
    "sk-globex-000000000000003"
OPERATOR = "sk-operator-00000000000004"
KEYS_FILE = f"""# tenant  key
acme     {KEY_A1}

acme     {KEY_A2}
globex   {KEY_B}
"""
HELLO = [{"role": "user", "content": "hi"}]


def keys_file(tmp_path: Path, text: str = KEYS_FILE, mode: int = 0o600) -> Path:
    path = tmp_path / "tenants.keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_keys_file_format() -> None:
    tenants = Tenants.from_text(KEYS_FILE)
    assert tenants.names == ["acme", "globex"]
    assert [tenants.tenant_of(k) for k in (KEY_A1, KEY_A2, KEY_B, "sk-nobody-000000000000")] == [
        "acme", "acme", "globex", None]
    assert KEY_A1 not in repr(tenants)
    for text, fragment in [
        ("acme", "line 1: expected 'TENANT KEY', got 1 fields"),
        (f"acme {KEY_A1} extra", "got 3 fields"),
        ("acme short", "line 1: the key is shorter than 16 characters"),
        (f"acme {KEY_A1}\nglobex {KEY_A1}", "line 2: this key is already given, for tenant "
                                            "'acme'"),
        (f"-bad {KEY_A1}", "a tenant name is"),
        ("# nothing\n\n", "no keys in it"),
    ]:
        with pytest.raises(ValueError, match=fragment) as err:
            Tenants.from_text(text)
        assert KEY_A1 not in str(err.value)


def test_keys_file_is_private(tmp_path: Path) -> None:
    path = keys_file(tmp_path, mode=0o640)
    with pytest.raises(SystemExit, match="chmod 600"):
        Tenants.from_file(str(path))
    path.chmod(0o600)
    assert Tenants.from_file(str(path)).names == ["acme", "globex"]
    with pytest.raises(SystemExit, match="--cache-salt-per-api-key .*line 1"):
        Tenants.from_file(str(keys_file(tmp_path, "acme")))


def test_salts_combine_and_never_collide() -> None:
    tenants = Tenants.from_text(KEYS_FILE)
    assert salted(None, None, "s") == "s" and salted(None, None, None) is None
    combos = [(t, s) for t in ("acme", "globex", None) for s in ("s", None, "acme", '"acme"')]
    salts = [salted(tenants, t, s) for t, s in combos]
    assert len(set(salts)) == len(combos)
    # a tenant cannot pick a salt that lands on another tenant's: the JSON keeps them apart
    assert salted(tenants, "acme", '["globex", null]') != salted(tenants, "globex", None)
    assert tenant_session("acme", "m|s1") != tenant_session("globex", "m|s1")
    assert tenant_session(None, "m|s1") == "m|s1"


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template, tmp_path) -> Iterator[TestClient]:
    options = ShimOptions(cache_salt_per_api_key=str(keys_file(tmp_path)))
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    api_key=OPERATOR, options=options)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_each_key_salts_with_its_tenant_in_every_api(client, engine) -> None:
    tenants = client.app.state.shim.tenants
    calls = [  # (key, how it is sent, own salt)
        (KEY_A1, "x-api-key", None), (KEY_A2, "bearer", None), (KEY_B, "x-api-key", None),
        (KEY_A1, "x-api-key", "s"), (OPERATOR, "bearer", None)]
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/completions"):
        engine.requests.clear()
        for key, how, salt in calls:
            headers = {"x-api-key": key} if how == "x-api-key" else {
                "authorization": f"Bearer {key}"}
            body = {"model": "m", "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
            body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": HELLO})
            engine.script("ok")
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
        got = [req.cache_salt for req in engine.requests]
        assert got == [salted(tenants, "acme", None), salted(tenants, "acme", None),
                       salted(tenants, "globex", None), salted(tenants, "acme", "s"),
                       salted(tenants, None, None)], path
        assert len(set(got)) == 4  # acme's two keys share one cache, the others do not
    # sessions never mix tenants (prefix tracker, the queue's round robin)
    engine.requests.clear()
    for key in (KEY_A1, KEY_B):
        engine.script("ok")
        client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": HELLO},
                    headers={"x-api-key": key, "x-claude-code-session-id": "same"})
    a, b = (req.session_id for req in engine.requests)
    assert a != b and a.startswith("tenant=acme|") and b.startswith("tenant=globex|")


def test_unknown_keys_are_refused_in_each_api_shape(client, engine) -> None:
    for headers in ({}, {"x-api-key": "sk-nobody-00000000000000"},
                    {"authorization": f"Bearer {KEY_A1}x"}):
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": HELLO},
                        headers=headers)
        assert_error(r, 401, "authentication_error")
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO},
                        headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert engine.requests == []
    assert client.get("/v1/models", headers={"x-api-key": KEY_B}).status_code == 200


def test_the_self_check_passes_without_a_key_of_its_own(engine, tiny_tokenizer, tiny_template,
                                                        tmp_path) -> None:
    """With only a keys file the gate has no key: its secret header admits it."""
    app = build_app(engine, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                    options=ShimOptions(cache_salt_per_api_key=str(keys_file(tmp_path))))
    with TestClient(app, raise_server_exceptions=False) as c:
        state = app.state.shim
        state.self_check_secret, state.unavailable = "gate-secret", "the self-check is running"
        body = {"model": "m", "max_tokens": 2, "messages": HELLO}
        engine.script("ok")
        assert c.post("/v1/messages", json=body,
                      headers={SELF_CHECK_HEADER: "gate-secret"}).status_code == 200
        assert engine.requests[0].cache_salt == salted(state.tenants, None, None)
        assert_error(c.post("/v1/messages", json=body, headers={SELF_CHECK_HEADER: "guess"}),
                     401, "authentication_error")
        assert c.post("/v1/messages", json=body, headers={"x-api-key": KEY_A1}).status_code == 503


def test_the_launcher_checks_the_file_and_hands_its_path_on(tmp_path: Path, default_model: Path,
                                                            monkeypatch) -> None:
    path = keys_file(tmp_path)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    monkeypatch.chdir(tmp_path)  # a relative path names the same file from the shim's cwd
    _, serve = build_config(p.parse_args(["--model", str(default_model), "--on-image", "reject",
                                          "--cache-salt-per-api-key", path.name]), world_size=1)
    argv = serve.shim_args()
    assert KEY_A1 not in " ".join(argv)  # the path travels, never the keys
    shim = ShimOptions.from_args(parse_args(["--run-dir", "/r", "--model", "/m", *argv]))
    assert (shim.on_image, shim.cache_salt_per_api_key) == ("reject", str(path.resolve()))
    path.chmod(0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        build_config(p.parse_args(["--model", str(default_model), "--cache-salt-per-api-key",
                                   str(path)]), world_size=1)
    with pytest.raises(SystemExit):
        p.parse_args(["--on-image", "ignore"])
