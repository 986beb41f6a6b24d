"""Anthropic Messages API responses, and its endpoints: `POST /v1/messages` (also
`?beta=true`, what Claude Code calls) and `POST /v1/messages/count_tokens` (the requests
are anthropic_request's; the pipeline is pipeline.serve).

Streaming is SSE with `event:` lines, in Anthropic's order:

    message_start
    (content_block_start, content_block_delta*, content_block_stop)*   thinking / text / tool_use
    message_delta (stop_reason, usage)
    message_stop

with `ping` events while a request waits for tokens, and `event: error` if the engine
fails mid-stream. Tool calls arrive whole from the parser and are streamed as one
`input_json_delta` each.

Usage (the three input counts add up to the prompt, as in Anthropic's API):

    cache_read_input_tokens      prompt tokens served from the prefix cache (any tier)
    cache_read_input_tokens_disk of those, read back from the disk tier (only when > 0)
    cache_creation_input_tokens  prompt tokens computed and written to full blocks, which
                                 later requests can read: full blocks - cached
    input_tokens                 the rest: computed, in the last partial block
    output_tokens                tokens generated (an EOS included)
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from orchestrator.shim.admission import (
    SchedulingHints,
    check_auth,
    check_counts,
    read_json_object,
)
from orchestrator.shim.anthropic_request import parse_messages_request, tool_input_json
from orchestrator.shim.chat import (
    ChatEvent,
    ChatRequest,
    ChatRun,
    normalise,
    parse_chat,
    prepare_chat,
    render_prompt,
)
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Generation
from orchestrator.shim.pipeline import Reply, serve
from orchestrator.shim.placeholders import check_replaced
from orchestrator.shim.reasoning import Reasoning
from orchestrator.shim.state import ServerState, shim_state, tokenize
from orchestrator.shim.tool_parsers import ToolCall


def sse_event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(run: ChatRun) -> dict[str, int]:
    gen = run.gen
    created = gen.cache_creation_tokens(run.state.block_size)
    out = {
        "input_tokens": gen.num_prompt_tokens - gen.num_cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": gen.num_cached,
        "output_tokens": len(gen.token_ids),
    }
    if gen.num_disk_cached:  # of cache_read_input_tokens, those read back from disk
        out["cache_read_input_tokens_disk"] = gen.num_disk_cached
    return out


def stop_reason(run: ChatRun) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence).

    An output cut by length says which limit cut it: the request's own max_tokens
    ("max_tokens": Claude Code then asks the model to continue, and fails after a few
    tries), the end of the context ("model_context_window_exceeded"), or the server's
    --max-output-tokens, which is the operator's limit on a turn and ends it
    ("end_turn"), so agents carry on with the shorter answer instead of failing.
    A whole tool call is "tool_use" even if the model wrote on past it until a limit:
    the call is complete, and an agent told "max_tokens" would not run it."""
    gen = run.gen
    if gen.stop_string is not None:
        return "stop_sequence", gen.stop_string
    if run.num_tool_calls:
        return "tool_use", None
    if gen.finish_reason == "length":
        by = run.limited_by
        if by == "server":
            return "end_turn", None
        return ("max_tokens" if by == "request" else "model_context_window_exceeded"), None
    return "end_turn", None


def thinking_signature(thinking: str) -> str:
    """A thinking block's `signature`. Clients send it back with the block and we do
    not check it (the block only goes back into the prompt); a digest of the text."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class BlockStream:
    """A streamed message's content blocks as SSE events: a thinking or text block stays
    open while its deltas come (a thinking block closes with its signature); a tool_use
    block arrives whole (one input_json_delta)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" or "text"
        self.thinking = ""

    def add(self, event: ChatEvent) -> list[str]:
        if isinstance(event, ToolCall):
            closed = self.close()
            self.index += 1
            return [*closed, _start(self.index, {
                "type": "tool_use", "id": tool_use_id(), "name": event.name, "input": {}}),
                _delta(self.index, {"type": "input_json_delta",
                                    "partial_json": tool_input_json(event.arguments)}),
                _stop(self.index)]
        if not event.text:
            return []
        out = []
        kind = "thinking" if isinstance(event, Reasoning) else "text"
        if self.open != kind:
            out += self.close()
            self.index += 1
            self.open = kind
            out.append(_start(self.index, {"type": "thinking", "thinking": "", "signature": ""}
                              if kind == "thinking" else {"type": "text", "text": ""}))
        if kind == "thinking":
            self.thinking += event.text
            out.append(_delta(self.index, {"type": "thinking_delta", "thinking": event.text}))
        else:
            out.append(_delta(self.index, {"type": "text_delta", "text": event.text}))
        return out

    def close(self) -> list[str]:
        """End the open thinking or text block, if any."""
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(_delta(self.index, {"type": "signature_delta",
                                           "signature": thinking_signature(self.thinking)}))
            self.thinking = ""
        self.open = None
        return [*out, _stop(self.index)]


def _start(index: int, block: dict[str, Any]) -> str:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                             "content_block": block})


def _delta(index: int, delta: dict[str, Any]) -> str:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                             "delta": delta})


def _stop(index: int) -> str:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


class MessageReply(Reply):
    """One /v1/messages answer: a message, or its SSE events (message_start with the first
    output or keep-alive; content blocks; message_delta and message_stop)."""

    def __init__(self, run: ChatRun, msg_id: str, model: str) -> None:
        self.run = run
        self.delivery = run.req.delivery
        self.msg_id = msg_id
        self.model = model
        self.blocks = BlockStream()

    def items(self) -> AsyncIterator[ChatEvent]:
        return self.run.events()

    @property
    def generation(self) -> Generation:
        return self.run.gen

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        self.run.log_done(finish_reason=finish_reason, error=error)

    async def collect(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        async for event in self.run.events():
            if isinstance(event, ToolCall):
                content.append({"type": "tool_use", "id": tool_use_id(), "name": event.name,
                                "input": event.arguments})
                continue
            if not event.text:
                continue
            kind = "thinking" if isinstance(event, Reasoning) else "text"
            if content and content[-1]["type"] == kind:
                content[-1][kind] += event.text
            else:
                content.append({"type": kind, kind: event.text})
        for block in content:
            if block["type"] == "thinking":
                block["signature"] = thinking_signature(block["thinking"])
        return self._message(content, final=True)

    def _message(self, content: list[dict[str, Any]], *, final: bool) -> dict[str, Any]:
        reason, sequence = stop_reason(self.run) if final else (None, None)
        return {"id": self.msg_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage(self.run)}

    def opening(self) -> list[str]:
        return [sse_event("message_start", {
            "type": "message_start", "message": self._message([], final=False)})]

    def ping(self) -> str:
        return sse_event("ping", {"type": "ping"})

    def chunks(self, item: ChatEvent) -> list[str]:
        return self.blocks.add(item)

    def error(self, err: ApiError) -> list[str]:
        return [sse_event("error", err.anthropic_body())]

    def closing(self) -> list[str]:
        reason, sequence = stop_reason(self.run)
        return [*self.blocks.close(), sse_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.run)}), sse_event("message_stop", {"type": "message_stop"})]


async def messages(request: Request) -> Response:
    return await serve(request, parse_chat(parse_messages_request), start_message)


async def start_message(state: ServerState, req: ChatRequest,
                        hints: SchedulingHints) -> MessageReply:
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    run = await prepare_chat(state, req, msg_id, api="anthropic", hints=hints)
    return MessageReply(run, msg_id, req.model or state.model_name)


async def count_tokens(request: Request) -> Response:
    state = shim_state(request)
    check_auth(request, state)  # it only tokenizes: it answers while the engine restarts
    body = await read_json_object(request, state)
    check_counts(body, state)
    req = parse_messages_request(body, request.headers, count_only=True)
    check_replaced(state, req.replaced, req.session)  # the same prompt as /v1/messages
    req = normalise(state, req)
    text = await render_prompt(state, req)
    ids = await tokenize(state.tokenizer, text, add_special_tokens=False)
    return JSONResponse({"input_tokens": len(ids)})
