"""Cache isolation and images against the real engine (`deepinfer-run serve`, one rank,
the tiny model, `--cache-salt-per-api-key`): the same salt shares blocks and another salt
never does (OpenAI chat `cached_tokens`, Anthropic `cache_read_input_tokens`), two keys
of one tenant share and two tenants do not, and a Claude Code session with screenshots
in its history is served and its next turn is read from cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.orchestrator.claude_code_body import claude_code_request, png, screenshot_history
from tests.orchestrator.e2e_helpers import Served
from tests.orchestrator.test_chat_e2e import sse

pytestmark = pytest.mark.slow

MAX_OUTPUT = 8  # --max-output-tokens: random text, CPU
KEYS = {"acme": ["sk-acme-e2e-000000000001", "sk-acme-e2e-000000000002"],
        "globex": ["sk-globex-e2e-0000000003"], "initech": ["sk-initech-e2e-000000004"]}
ACME, ACME_2 = KEYS["acme"]
DOCUMENT = ("The prefix cache keeps every full block of a finished conversation, so the "
            "next turn of an agent reads it back instead of computing it again. ") * 6


@pytest.fixture(scope="module")
def served(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("salt")
    keys = tmp / "tenants.keys"
    keys.write_text("".join(f"{t} {k}\n" for t, ks in KEYS.items() for k in ks))
    keys.chmod(0o600)
    engine = Served(default_model, tmp / "run", nproc=1, extra_args=[
        "--max-output-tokens", str(MAX_OUTPUT), "--cache-salt-per-api-key", str(keys)])
    yield engine
    assert engine.stop() == 0, engine.log()[-3000:]


def chat(url: str, key: str, question: str, **body: Any) -> dict[str, int]:
    """An OpenAI chat completion; its prompt tokens and cached tokens."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                   headers={"authorization": f"Bearer {key}"},
                   json={"model": "tiny", "max_tokens": 2, "temperature": 0, **body,
                         "messages": [{"role": "user", "content": DOCUMENT + question}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"][
        "cached_tokens"]}


def message(url: str, key: str, question: str, **body: Any) -> dict[str, int]:
    r = httpx.post(f"{url}/v1/messages", timeout=300, headers={"x-api-key": key},
                   json={"model": "tiny", "max_tokens": 2, "temperature": 0, **body,
                         "messages": [{"role": "user", "content": DOCUMENT + question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def all_but_the_last_block(n: int) -> int:
    """What a repeat of an n-token prompt reads from cache: every full block, the last
    token excepted (it is computed again for its logits)."""
    return (n - 1) // 16 * 16


def test_the_same_salt_shares_blocks_and_another_never(served) -> None:
    first = chat(served.url, ACME, "Q1?", cache_salt="blue")
    assert first["cached"] == 0 and first["prompt"] > 100
    again = chat(served.url, ACME, "Q1?", cache_salt="blue")
    assert again["cached"] == all_but_the_last_block(first["prompt"])
    assert chat(served.url, ACME, "Q1?", cache_salt="green")["cached"] == 0
    # the Anthropic body's extension field, the same way
    m = message(served.url, ACME, "Q2?", cache_salt="red")
    n = m["input_tokens"] + m["cache_creation_input_tokens"] + m["cache_read_input_tokens"]
    assert message(served.url, ACME, "Q2?", cache_salt="red")["cache_read_input_tokens"] == \
        all_but_the_last_block(n)
    assert message(served.url, ACME, "Q2?", cache_salt="yellow")["cache_read_input_tokens"] == 0
    r = httpx.post(f"{served.url}/v1/messages", timeout=60, headers={"x-api-key": ACME},
                   json={"model": "tiny", "max_tokens": 2, "cache_salt": 5,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_per_key_salting_isolates_tenants_and_shares_within_one(served) -> None:
    question = "Which tenant am I?"
    first = chat(served.url, KEYS["initech"][0], question)
    assert first["cached"] == 0
    # globex sends the very same prompt: none of initech's blocks
    assert chat(served.url, KEYS["globex"][0], question)["cached"] == 0
    # acme's two keys are one tenant: one cache
    assert chat(served.url, ACME, question)["cached"] == 0
    assert chat(served.url, ACME_2, question)["cached"] == all_but_the_last_block(
        first["prompt"])
    # and no salt of its own lands a tenant in another's cache
    assert chat(served.url, KEYS["globex"][0], question, cache_salt="initech")["cached"] == 0
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                   headers={"authorization": "Bearer sk-nobody-000000000000"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401


def claude_code_turn(url: str, key: str, session: str,
                     messages: list[dict[str, Any]]) -> dict[str, Any]:
    body, headers = claude_code_request(session, messages)
    body["temperature"] = 0
    headers["x-api-key"] = key
    with httpx.stream("POST", f"{url}/v1/messages?beta=true", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = sse(r)
    text = "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta")
    usage = [d for k, d in events if k == "message_delta"][0]["usage"]
    return {"text": text, "usage": usage}


def metric(url: str, key: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", headers={"x-api-key": key}, timeout=30).text.splitlines()
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ")),
                0.0)


def test_a_claude_code_session_with_screenshots_keeps_hitting_the_cache(served) -> None:
    """Each image becomes a stable placeholder: the session is served (no 400 it could
    never recover from), and its next turn, the same history plus a new question, is
    read from cache up to the new turn."""
    session = "5c1ee0c5-dddd-4000-8000-000000000005"
    images = 'deepinfer_unsupported_blocks_total{type="image"}'
    before = metric(served.url, ACME, images)
    breaks = metric(served.url, ACME, "deepinfer_prefix_breaks_total")
    history = screenshot_history(png(64, 40))
    first = claude_code_turn(served.url, ACME, session, history)
    u = first["usage"]
    total = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
    assert total > 1000 and u["output_tokens"] >= 1
    history += [{"role": "assistant", "content": [{"type": "text", "text": first["text"]}]},
                {"role": "user", "content": [{"type": "text", "text": "Fix it, please.",
                                              "cache_control": {"type": "ephemeral"}}]}]
    second = claude_code_turn(served.url, ACME, session, history)["usage"]
    second_total = (second["input_tokens"] + second["cache_creation_input_tokens"]
                    + second["cache_read_input_tokens"])
    assert second["cache_read_input_tokens"] >= all_but_the_last_block(
        total + u["output_tokens"]), (u, second)
    assert second["cache_read_input_tokens"] > 0.9 * second_total
    assert metric(served.url, ACME, images) == before + 4  # two images, in each of two turns
    assert metric(served.url, ACME, "deepinfer_prefix_breaks_total") == breaks
