"""The render endpoints: a request's prompt token ids exactly as the engine would prefill
them, for a router that routes by prefix (SMG, llm-d's endpoint picker).

    POST /v1/chat/completions/render   an OpenAI chat body
    POST /v1/completions/render        an OpenAI completions body
    POST /v1/messages/render           an Anthropic Messages body
    POST /v1/responses/render          an OpenAI Responses body
    -> {"token_ids": [...]}

A router that tokenizes on its own, with another template or without our rewrites
(the Claude Code billing header dropped, thinking rendered, the session's previous ids
reused where the text extends them), computes keys no replica holds and silently
routes on load alone. So each endpoint runs the generating endpoint's own parse and
render (chat.render_chat, openai_request.parse_completion_body) and stops before the
engine: it neither queues anything nor changes a session's state.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from orchestrator.shim.admission import admit, read_json_object, scheduling_hints
from orchestrator.shim.anthropic_request import parse_messages_request
from orchestrator.shim.chat import parse_chat, render_chat, spliced_token_ids
from orchestrator.shim.openai_request import parse_chat_request, parse_completion_body
from orchestrator.shim.responses_response import parse_body as parse_responses_body
from orchestrator.shim.state import ServerState, shim_state


async def _body(request: Request) -> tuple[ServerState, str | None, dict[str, Any]]:
    state = shim_state(request)
    tenant = admit(request, state)
    return state, tenant, await read_json_object(request, state)


async def _chat(request: Request, parse: Any) -> Response:
    state, tenant, body = await _body(request)
    req = await parse_chat(parse)(state, body, request.headers)
    req, _, text = await render_chat(state, req, scheduling_hints(request, state, tenant))
    return JSONResponse({"token_ids": await spliced_token_ids(state, req.session, text)})


async def chat_completions(request: Request) -> Response:
    return await _chat(request, parse_chat_request)


async def messages(request: Request) -> Response:
    return await _chat(request, parse_messages_request)


async def completions(request: Request) -> Response:
    state, _, body = await _body(request)
    generate, _ = await parse_completion_body(state, body, request.headers)
    return JSONResponse({"token_ids": generate.prompt_token_ids})


async def responses(request: Request) -> Response:
    state, tenant, body = await _body(request)
    parsed = await parse_responses_body(state, body, request.headers)
    req, _, text = await render_chat(state, parsed.chat, scheduling_hints(request, state, tenant))
    return JSONResponse({"token_ids": await spliced_token_ids(state, req.session, text)})
