"""cache_control markers -> the GenerateRequest's retention entries (prompt tokens + TTL),
in both APIs; the markers never change the prompt."""

from __future__ import annotations

import json

import pytest

from orchestrator.shim.retention import common_prefix_len, tokens_within
from tests.orchestrator.claude_code_body import claude_code_request, first_user_turn
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_anthropic_api import make_client


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=8192)


def send(engine, tiny_tokenizer, tiny_template, body, path="/v1/messages", headers=None):
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        r = c.post(path, json=body, headers=headers or {})
    return r, engine.requests[-1] if engine.requests else None


def test_claude_code_marks_keep_the_whole_prompt(engine, tiny_tokenizer, tiny_template):
    body, headers = claude_code_request("s1", [first_user_turn("say hello")], stream=False)
    r, req = send(engine, tiny_tokenizer, tiny_template, body, headers=headers)
    assert r.status_code == 200, r.text
    # the system marks are inside the last marked span: one entry, 5 minutes, everything
    assert [(x.num_tokens, x.ttl_s) for x in req.retention] == [
        (len(req.prompt_token_ids), 300.0)]


def test_an_earlier_mark_keeps_the_prompt_up_to_its_message(engine, tiny_tokenizer,
                                                            tiny_template):
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "first question " * 20,
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "assistant", "content": "an answer " * 20},
        {"role": "user", "content": "a new question with no marker " * 5},
    ]
    body = {"model": "m", "max_tokens": 4, "messages": turns}
    r, req = send(engine, tiny_tokenizer, tiny_template, body)
    assert r.status_code == 200, r.text
    [kept] = req.retention
    assert kept.ttl_s == 3600.0
    # the first turn's tokens, not the rest: compare with rendering that turn alone
    alone = tiny_template.render([{"role": "user", "content": "first question " * 20}],
                                 add_generation_prompt=False)
    want = len(tiny_tokenizer.encode(alone, add_special_tokens=False).ids)
    assert want - 2 <= kept.num_tokens <= want + 1
    assert kept.num_tokens < len(req.prompt_token_ids) - 40


def test_markers_do_not_change_the_prompt(engine, tiny_tokenizer, tiny_template):
    body, headers = claude_code_request("s2", [first_user_turn("hello")], stream=False)
    send(engine, tiny_tokenizer, tiny_template, body, headers=headers)
    plain = json.loads(json.dumps(body).replace(', "cache_control": {"type": "ephemeral"}', ""))
    assert "cache_control" not in json.dumps(plain)
    send(engine, tiny_tokenizer, tiny_template, plain, headers=headers)
    marked, unmarked = engine.requests[-2:]
    assert marked.prompt_token_ids == unmarked.prompt_token_ids
    assert marked.retention and not unmarked.retention


def test_bad_ttl_is_a_400_in_the_api_shape(engine, tiny_tokenizer, tiny_template):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}]}
    r, _ = send(engine, tiny_tokenizer, tiny_template, body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "ttl" in err["error"]["message"]


def test_openai_chat_and_completions_take_the_hint(engine, tiny_tokenizer, tiny_template):
    chat = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "hi"}]}
    r, req = send(engine, tiny_tokenizer, tiny_template, chat, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    [kept] = req.retention
    assert 0 < kept.num_tokens < len(req.prompt_token_ids) and kept.ttl_s == 300.0
    completion = {"model": "m", "max_tokens": 4, "prompt": "once upon a time",
                  "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    r, req = send(engine, tiny_tokenizer, tiny_template, completion, "/v1/completions")
    assert r.status_code == 200, r.text
    assert [(x.num_tokens, x.ttl_s) for x in req.retention] == [
        (len(req.prompt_token_ids), 3600.0)]
    bad = {**completion, "cache_control": {"type": "forever"}}
    r, _ = send(engine, tiny_tokenizer, tiny_template, bad, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_token_counts_of_a_text_prefix(tiny_tokenizer):
    text = "def main():\n    print('héllo wörld')\n" * 3
    ids = tiny_tokenizer.encode(text, add_special_tokens=False).ids
    assert tokens_within(tiny_tokenizer, ids, text, len(text)) == len(ids)
    half = text.index("\n", len(text) // 2) + 1
    n = tokens_within(tiny_tokenizer, ids, text, half)
    assert tiny_tokenizer.decode(ids[:n]) == text[:half][: len(tiny_tokenizer.decode(ids[:n]))]
    assert abs(n - len(tiny_tokenizer.encode(text[:half], add_special_tokens=False).ids)) <= 1
    assert common_prefix_len("abcX", "abcdef") == 3 and common_prefix_len("ab", "abc") == 2
