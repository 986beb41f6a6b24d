"""The sampling fields of OpenAI's two endpoints, read by one validator
(orchestrator/shim/openai_sampling.py): the same value gets the same answer from
/v1/chat/completions and /v1/completions, within OpenAI's limits; what the engine does not
apply (penalties, logit_bias, n > 1) is refused alike unless it is the default."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from orchestrator.shim.server import build_app
from tests.orchestrator.scripted_engine import ScriptedEngine

ACCEPTED = [
    ("temperature", 0), ("temperature", 2), ("temperature", 0.7), ("temperature", None),
    ("top_p", 1), ("top_p", 0.05), ("top_k", -1), ("top_k", 0), ("top_k", 40),
    ("seed", 7), ("seed", -(2**63)),
    # the defaults, as SDKs and frameworks send them unasked
    ("presence_penalty", 0), ("presence_penalty", 0.0), ("presence_penalty", None),
    ("frequency_penalty", 0), ("logit_bias", {}), ("logit_bias", None), ("n", 1),
]
REFUSED = [
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", "1"), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", [1]),
    ("top_k", -2), ("top_k", 1.5), ("top_k", 10**30),
    ("seed", "7"), ("seed", 2**64),
    ("presence_penalty", 0.5), ("presence_penalty", -2.5), ("presence_penalty", "0"),
    ("frequency_penalty", -1), ("frequency_penalty", 2.01),
    ("logit_bias", {"50256": -100}), ("logit_bias", [1]),
    ("n", 2), ("n", 0), ("n", "1"),
]
UNSUPPORTED = [("presence_penalty", 0.5), ("frequency_penalty", -1),
               ("logit_bias", {"50256": -100}), ("n", 2)]


@pytest.fixture
def client(tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    app = build_app(ScriptedEngine(tiny_tokenizer), tiny_tokenizer, model_name="tiny",
                    chat_template=tiny_template)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def answers(client: TestClient, field: str, value: Any) -> list[tuple[int, dict | None]]:
    """(status, error) from each endpoint for a body with `field` set to `value`."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    completion = {"prompt": "hi"}
    out = []
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        r = client.post(path, json={"model": "m", "max_tokens": 2, **body, field: value})
        out.append((r.status_code, r.json().get("error")))
    return out


@pytest.mark.parametrize("field, value", ACCEPTED)
def test_both_endpoints_accept_the_same_values(client, field, value) -> None:
    chat, completion = answers(client, field, value)
    assert chat == completion == (200, None)


@pytest.mark.parametrize("field, value", REFUSED)
def test_both_endpoints_refuse_the_same_values_in_the_same_words(client, field,
                                                                 value) -> None:
    chat, completion = answers(client, field, value)
    assert chat == completion
    status, error = chat
    assert status == 400 and error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"'{field}'")
    assert error["code"] == ("unsupported" if (field, value) in UNSUPPORTED else None)


def test_the_refusals_say_why(client) -> None:
    (_, error), _ = answers(client, "presence_penalty", 0.5)
    assert error["message"] == ("'presence_penalty' = 0.5 is not supported: this engine "
                                "applies no penalties (0, the default, is accepted)")
    (_, error), _ = answers(client, "temperature", 2.5)
    assert error["message"] == "'temperature' must be in [0, 2], got 2.5"
    (_, error), _ = answers(client, "frequency_penalty", -3)
    assert error["message"] == "'frequency_penalty' must be in [-2, 2], got -3"
