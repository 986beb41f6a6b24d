"""Anthropic Messages API: `POST /v1/messages` (also `?beta=true`, what Claude Code
calls) and `POST /v1/messages/count_tokens`.

Streaming is SSE with `event:` lines, in Anthropic's order:

    message_start
    (content_block_start, content_block_delta*, content_block_stop)*   text / tool_use
    message_delta (stop_reason, usage)
    message_stop

with `ping` events while a request waits for tokens, and `event: error` if the engine
fails mid-stream. Tool calls arrive whole from the parser and are streamed as one
`input_json_delta` each.

Usage (the three input counts add up to the prompt, as in Anthropic's API):

    cache_read_input_tokens      prompt tokens served from the prefix cache (either tier)
    cache_creation_input_tokens  prompt tokens computed and written to full blocks, which
                                 later requests can read: full blocks - cached
    input_tokens                 the rest: computed, in the last partial block
    output_tokens                tokens generated (an EOS included)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from orchestrator.anthropic_request import parse_messages_request, tool_input_json
from orchestrator.chat_run import ChatRun, render_prompt, start_chat
from orchestrator.errors import ApiError
from orchestrator.generation import with_keepalive
from orchestrator.http_common import (
    check_auth,
    check_counts,
    json_result,
    read_json_object,
    shim_state,
    sse_response,
    tokenize,
)
from orchestrator.tool_parsers import TextEvent, ToolCall


def sse_event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(run: ChatRun) -> dict[str, int]:
    gen = run.gen
    created = gen.cache_creation_tokens(run.state.block_size)
    return {
        "input_tokens": gen.num_prompt_tokens - gen.num_cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": gen.num_cached,
        "output_tokens": len(gen.token_ids),
    }


def stop_reason(run: ChatRun) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence).

    An output cut by length says which limit cut it: the request's own max_tokens
    ("max_tokens": Claude Code then asks the model to continue, and fails after a few
    tries), the end of the context ("model_context_window_exceeded"), or the server's
    --max-output-tokens, which is the operator's limit on a turn and ends it
    ("end_turn"), so agents carry on with the shorter answer instead of failing."""
    gen = run.gen
    if gen.stop_string is not None:
        return "stop_sequence", gen.stop_string
    if gen.finish_reason == "length":
        by = run.limited_by
        if by == "server":
            return "end_turn", None
        return ("max_tokens" if by == "request" else "model_context_window_exceeded"), None
    if run.num_tool_calls:
        return "tool_use", None
    return "end_turn", None


def _message(run: ChatRun, msg_id: str, model: str, content: list[dict[str, Any]],
             *, final: bool) -> dict[str, Any]:
    reason, sequence = stop_reason(run) if final else (None, None)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(run)}


async def collect(run: ChatRun, msg_id: str, model: str) -> dict[str, Any]:
    """The non-streaming response."""
    content: list[dict[str, Any]] = []
    async for event in run.events():
        if isinstance(event, ToolCall):
            content.append({"type": "tool_use", "id": tool_use_id(), "name": event.name,
                            "input": event.arguments})
        elif event.text:
            if content and content[-1]["type"] == "text":
                content[-1]["text"] += event.text
            else:
                content.append({"type": "text", "text": event.text})
    return _message(run, msg_id, model, content, final=True)


async def stream(run: ChatRun, msg_id: str, model: str,
                 ping_interval_s: float) -> AsyncIterator[str]:
    """The streaming response. Its first chunk (message_start) comes with the first
    output, or after `ping_interval_s` without one: an engine error before it is
    still an HTTP error status (see sse_response)."""
    events = run.events()
    keepalive = with_keepalive(events, ping_interval_s)
    started = False
    index = -1
    text_open = False
    try:
        async for event in keepalive:
            if not started:
                started = True
                yield sse_event("message_start", {
                    "type": "message_start",
                    "message": _message(run, msg_id, model, [], final=False)})
            if event is None:
                yield sse_event("ping", {"type": "ping"})
            elif isinstance(event, TextEvent):
                if not event.text:
                    continue
                if not text_open:
                    index += 1
                    text_open = True
                    yield sse_event("content_block_start", {
                        "type": "content_block_start", "index": index,
                        "content_block": {"type": "text", "text": ""}})
                yield sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": event.text}})
            else:
                if text_open:
                    text_open = False
                    yield sse_event("content_block_stop",
                                    {"type": "content_block_stop", "index": index})
                index += 1
                yield sse_event("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": tool_use_id(),
                                      "name": event.name, "input": {}}})
                yield sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta",
                              "partial_json": tool_input_json(event.arguments)}})
                yield sse_event("content_block_stop",
                                {"type": "content_block_stop", "index": index})
    except ApiError as err:
        run.log_done(finish_reason="error", error=err.message)
        if not started:
            raise
        yield sse_event("error", err.anthropic_body())
        return
    finally:
        await keepalive.aclose()  # first: it may be waiting on `events`
        await events.aclose()
        run.log_done()  # no-op unless the client left early (logged as an abort)
    if not started:
        yield sse_event("message_start", {
            "type": "message_start", "message": _message(run, msg_id, model, [], final=False)})
    if text_open:
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    reason, sequence = stop_reason(run)
    yield sse_event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": usage(run)})
    yield sse_event("message_stop", {"type": "message_stop"})


async def messages(request: Request) -> Response:
    state = shim_state(request)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    req, run = await start_chat(request, parse_messages_request, msg_id, api="anthropic")
    model = req.model or state.model_name
    if not req.stream:
        return await json_result(request, collect(run, msg_id, model), run.log_done)
    return await sse_response(request, stream(run, msg_id, model, state.ping_interval_s),
                              run.log_done)


async def count_tokens(request: Request) -> Response:
    state = shim_state(request)
    check_auth(request, state)  # it only tokenizes: it answers while the engine restarts
    body = await read_json_object(request, state)
    check_counts(body, state)
    req = parse_messages_request(body, request.headers, count_only=True)
    text = await render_prompt(state, req)
    ids = await tokenize(state.tokenizer, text, add_special_tokens=False)
    return JSONResponse({"input_tokens": len(ids)})
