"""A client's session id, in whichever header it sends it, reaches the engine from every
API: the engine's session retention and its miss reasons key on it (issue: the engine
knows a request's session from `metadata.user_id`, `prompt_cache_key`, and the
`session-id` / `x-session-id` / `x-session-affinity` headers, else its prefix chains)."""

from __future__ import annotations

import pytest

from orchestrator.shim.anthropic_request import parse_messages_request
from orchestrator.shim.chat import SESSION_HEADERS
from orchestrator.shim.openai_request import (
    completion_session,
    parse_chat_request,
    parse_completion,
)
from orchestrator.shim.responses_request import parse_responses_request

MESSAGES = [{"role": "user", "content": "hi"}]


def every_api(headers: dict[str, str], **body_extra) -> dict[str, str | None]:
    """The session each API's parser gives a minimal request with these headers."""
    chat = parse_chat_request({"model": "m", "messages": MESSAGES, **body_extra}, headers)
    anthropic = parse_messages_request({"model": "m", "max_tokens": 8, "messages": MESSAGES},
                                       headers)
    responses = parse_responses_request({"model": "m", "input": "hi"}, headers)
    completion = {"model": "m", "prompt": [5, 6], **body_extra}
    request, _ = parse_completion(completion, [5, 6], vocab_size=100, max_model_len=64,
                                  session=completion_session(completion, headers))
    return {"chat": chat.session, "anthropic": anthropic.session,
            "responses": responses.chat.session, "completions": request.session_id}


@pytest.mark.parametrize("header", SESSION_HEADERS)
def test_every_api_reads_every_session_header(header):
    assert set(SESSION_HEADERS) >= {"session-id", "x-session-id", "x-session-affinity"}
    sessions = every_api({header: "agent-7"})
    assert sessions == dict.fromkeys(sessions, "m|agent-7")


def test_without_a_session_id_completions_leave_it_to_the_engine():
    sessions = every_api({})
    assert sessions["completions"] is None  # the scheduler tells sessions by their prefixes
    # the chat APIs key a conversation by its start instead
    assert all(s.startswith("m|conv-") for api, s in sessions.items() if api != "completions")
    assert every_api({}, user="u-1")["completions"] == "m|u-1"
    assert every_api({"x-session-id": "h"}, user="u-1")["completions"] == "m|h"
