"""OpenAI responses, and the endpoints: `POST /v1/chat/completions` (tools, reasoning,
cached-token usage) and `POST /v1/completions`, as one JSON body or as data-only SSE
ending in `data: [DONE]`, as OpenAI sends it (the requests are openai_request's; the
pipeline is pipeline.serve). A keep-alive is an SSE comment, which OpenAI clients skip.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from orchestrator.shim.admission import SchedulingHints
from orchestrator.shim.cache_report import cache_comment
from orchestrator.shim.chat import ChatEvent, ChatRequest, ChatRun, parse_chat, prepare_chat
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Delivery, Generation, Piece
from orchestrator.shim.openai_request import parse_chat_request, parse_completion_body
from orchestrator.shim.pipeline import Reply, serve
from orchestrator.shim.reasoning import Reasoning
from orchestrator.shim.state import ServerState
from orchestrator.shim.tenants import salted
from orchestrator.shim.tool_parsers import ToolCall
from wire.client import GenerateRequest

SSE_DONE = "data: [DONE]\n\n"
SSE_PING = ": ping\n\n"  # an SSE comment: keeps the connection busy; clients skip it


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(gen: Generation) -> dict[str, Any]:
    num_prompt, num_completion = gen.num_prompt_tokens, len(gen.token_ids)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        # cached_tokens_disk: of cached_tokens, those read back from the disk tier
        "prompt_tokens_details": {"cached_tokens": gen.num_cached, **(
            {"cached_tokens_disk": gen.num_disk_cached} if gen.num_disk_cached else {})},
    }


class OpenAIReply(Reply):
    """What both OpenAI streams share: comments as keep-alives, the cache report as a
    comment before the closing chunks (cache_report.py), an error as a data event,
    [DONE] at the end either way."""

    def ping(self) -> str:
        return SSE_PING

    def trailer(self) -> list[str]:
        return cache_comment(self.generation)

    def error(self, err: ApiError) -> list[str]:
        return [sse(err.body()), SSE_DONE]


# --- /v1/chat/completions ---------------------------------------------------------------


def _finish_reason(run: ChatRun) -> str:
    """A whole tool call wins over a length cut after it (as in Anthropic's stop_reason)."""
    if run.num_tool_calls:
        return "tool_calls"
    return "length" if run.gen.finish_reason == "length" else "stop"


def _tool_call(event: ToolCall, index: int | None = None) -> dict[str, Any]:
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": event.name,
                         "arguments": json.dumps(event.arguments, ensure_ascii=False)}}
    return call if index is None else {"index": index, **call}


def _chat_usage(run: ChatRun) -> dict[str, Any]:
    counts = usage(run.gen)
    counts["completion_tokens_details"] = {"reasoning_tokens": run.gen.num_reasoning_tokens}
    return counts


class ChatReply(OpenAIReply):
    """One chat completion: a message, or chunks (the role first, with the first output
    or keep-alive; then deltas; the finish reason; usage if asked)."""

    ping_with_opening = False  # the role chunk is the first keep-alive

    def __init__(self, run: ChatRun, base: dict[str, Any]) -> None:
        self.run = run
        self.delivery = run.req.delivery
        self.base = base  # id, created, model
        self.num_calls = 0

    def items(self) -> AsyncIterator[ChatEvent]:
        return self.run.events()

    @property
    def generation(self) -> Generation:
        return self.run.gen

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        self.run.log_done(finish_reason=finish_reason, error=error)

    async def collect(self) -> dict[str, Any]:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        async for event in self.run.events():
            if isinstance(event, ToolCall):
                calls.append(_tool_call(event))
            elif isinstance(event, Reasoning):
                reasoning.append(event.text)
            else:
                texts.append(event.text)
        # null only beside tool calls, as OpenAI: an empty answer is ""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(texts) or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if reasoning:  # vLLM's and DeepSeek's field
            message["reasoning_content"] = "".join(reasoning)
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": _finish_reason(self.run)}
        return {**self.base, "object": "chat.completion", "choices": [choice],
                "usage": _chat_usage(self.run)}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        c = {**self.base, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}]}
        if self.delivery.include_usage:
            c["usage"] = None  # as OpenAI: null on all chunks but the last
        return sse(c)

    def opening(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def chunks(self, item: ChatEvent) -> list[str]:
        if isinstance(item, ToolCall):
            self.num_calls += 1
            return [self._chunk({"tool_calls": [_tool_call(item, self.num_calls - 1)]})]
        if not item.text:
            return []
        key = "reasoning_content" if isinstance(item, Reasoning) else "content"
        return [self._chunk({key: item.text})]

    def closing(self) -> list[str]:
        out = [self._chunk({}, _finish_reason(self.run))]
        if self.delivery.include_usage:
            out.append(sse({**self.base, "object": "chat.completion.chunk", "choices": [],
                            "usage": _chat_usage(self.run)}))
        return [*out, SSE_DONE]


async def chat_completions(request: Request) -> Response:
    return await serve(request, parse_chat(parse_chat_request), start_chat_completion)


async def start_chat_completion(state: ServerState, req: ChatRequest,
                                hints: SchedulingHints) -> ChatReply:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = await prepare_chat(state, req, request_id, api="chat", hints=hints)
    return ChatReply(run, {"id": request_id, "created": int(time.time()),
                           "model": req.model or state.model_name})


# --- /v1/completions --------------------------------------------------------------------


class CompletionReply(OpenAIReply):
    """One text completion: one JSON, or a chunk per piece of text (and a last usage
    chunk if asked)."""

    def __init__(self, gen: Generation, model_name: str) -> None:
        self.gen = gen
        self.delivery = gen.delivery
        self.model_name = model_name
        self.created = int(time.time())

    def items(self) -> AsyncIterator[Piece]:
        return self.gen.pieces()

    @property
    def generation(self) -> Generation:
        return self.gen

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        self.gen.log_done(finish_reason=finish_reason, error=error)

    def _response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.gen.request_id, "object": "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices}

    def _choice(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None,
                "finish_reason": self.gen.finish_reason,
                "token_ids": token_ids}  # token_ids: extension, to compare outputs exactly

    async def collect(self) -> dict[str, Any]:
        text = "".join([p.text async for p in self.gen.pieces()])
        return {**self._response([self._choice(text, self.gen.token_ids)]),
                "usage": usage(self.gen)}

    def chunks(self, item: Piece) -> list[str]:
        chunk = self._response([self._choice(item.text, item.token_ids)])
        if self.delivery.include_usage:
            chunk["usage"] = None  # as OpenAI: null on all chunks but the last
        return [sse(chunk)]

    def closing(self) -> list[str]:
        if self.delivery.include_usage:
            return [sse({**self._response([]), "usage": usage(self.gen)}), SSE_DONE]
        return [SSE_DONE]


async def completions(request: Request) -> Response:
    return await serve(request, parse_completion_body, start_completion)


async def start_completion(state: ServerState, parsed: tuple[GenerateRequest, Delivery],
                           hints: SchedulingHints) -> CompletionReply:
    request, delivery = parsed
    request = replace(request, request_id=f"cmpl-{uuid.uuid4().hex}",
                      priority=hints.priority, timeout_s=hints.timeout_s,
                      cache_salt=salted(state.tenants, hints.tenant, request.cache_salt))
    gen = Generation(state.engine, state.tokenizer, request, delivery)
    if hints.tenant is not None:
        gen.log_fields["tenant"] = hints.tenant
    return CompletionReply(gen, state.model_name)
