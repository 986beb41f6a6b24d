"""OpenAI Responses API responses, and its endpoint `POST /v1/responses` (the requests
are responses_request's; the pipeline is pipeline.serve; the run is chat.py's).

The answer is a list of output items, in the order the model wrote them: `reasoning`
(its text as reasoning_text content, when a reasoning parser is configured), `message`
(one output_text part) and `function_call` (a fresh call_id; arguments as a JSON string).
Streamed, as SSE with `event:` lines and a `sequence_number` on every event:

    response.created, response.in_progress            (with the first output or keep-alive)
    per item: response.output_item.added
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done,
                   content_part.done
        call:      function_call_arguments.delta (the whole call: the parser yields it
                   whole), function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete          (with usage)

An error before the first event is an HTTP error in OpenAI's JSON; after it,
`response.failed` with `error.code`: context_length_exceeded, rate_limit_exceeded ("try
again in Ns") or server_error. A cut by the request's own max_output_tokens or by the
context's end is `incomplete` (reason max_output_tokens); a cut by the server's
--max-output-tokens ends the turn as `completed`, as the Messages API makes it end_turn,
so an agent carries on with the shorter answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from orchestrator.shim.admission import SchedulingHints, check_counts
from orchestrator.shim.cache_report import cache_comment
from orchestrator.shim.chat import ChatEvent, ChatRun, prepare_chat
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Generation
from orchestrator.shim.pipeline import Reply, serve
from orchestrator.shim.placeholders import check_replaced
from orchestrator.shim.reasoning import Reasoning
from orchestrator.shim.responses_request import ResponsesRequest, parse_responses_request
from orchestrator.shim.state import ServerState
from orchestrator.shim.tool_parsers import ToolCall

SSE_PING = ": ping\n\n"  # an SSE comment: clients skip it


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(run: ChatRun) -> dict[str, Any]:
    gen = run.gen
    num_input, num_output = gen.num_prompt_tokens, len(gen.token_ids)
    return {"input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": gen.num_cached},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": gen.num_reasoning_tokens},
            "total_tokens": num_input + num_output}


def status(run: ChatRun) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details). A whole tool call completes the answer even if the
    model wrote on past it to a limit; the server's own cap completes it too."""
    if run.gen.finish_reason == "length" and not run.num_tool_calls \
            and run.limited_by != "server":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def failure_code(err: ApiError) -> str:
    if err.code == "context_length_exceeded":
        return "context_length_exceeded"
    if err.status == 429:
        return "rate_limit_exceeded"
    return "server_error"


def with_retry_hint(err: ApiError) -> ApiError:
    """An overload's message says when to retry, in the words Codex reads ("try again in
    Ns"), from the retry-after the engine's error carries."""
    if err.status != 429 or "try again in" in err.message.lower():
        return err
    seconds = err.headers.get("retry-after", "1")
    return ApiError(f"{err.message}. Please try again in {seconds}s.", status=err.status,
                    type=err.type, param=err.param, code=err.code, headers=err.headers)


class OutputItems:
    """Chat events -> output items, and the stream events that build them: a message or
    a reasoning item stays open while its deltas come; a function call arrives whole."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.items: list[dict[str, Any]] = []  # done
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written
        self.text = ""

    @property
    def _index(self) -> int:
        return len(self.items)

    def add(self, event: ChatEvent) -> list[dict[str, Any]]:
        if isinstance(event, ToolCall):
            return [*self.close(), *self._call(event)]
        if not event.text:
            return []
        kind = "reasoning" if isinstance(event, Reasoning) else "message"
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            out += self._start(kind)
        self.text += event.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        out.append({"type": delta, "item_id": self.open["id"], "output_index": self._index,
                    "content_index": 0, "delta": event.text,
                    **({} if kind == "reasoning" else {"logprobs": []})})
        return out

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            self.open = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                         "encrypted_content": None, "status": "in_progress"}
        else:
            self.open = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                         "role": "assistant", "content": []}
        self.text = ""
        return [{"type": "response.output_item.added", "output_index": self._index,
                 "item": dict(self.open)},
                {"type": "response.content_part.added", "item_id": self.open["id"],
                 "output_index": self._index, "content_index": 0, "part": self._part("")}]

    def _part(self, text: str) -> dict[str, Any]:
        assert self.open is not None
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def close(self) -> list[dict[str, Any]]:
        """End the open message or reasoning item, if any."""
        item = self.open
        if item is None:
            return []
        part = self._part(self.text)
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else \
            "response.output_text.done"
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        item.update(content=[part], status="completed")
        out = [{"type": done, **where, "text": self.text,
                **({} if item["type"] == "reasoning" else {"logprobs": []})},
               {"type": "response.content_part.done", **where, "part": part},
               {"type": "response.output_item.done", "output_index": self._index,
                "item": item}]
        self.items.append(item)
        self.open, self.text = None, ""
        return out

    def _call(self, event: ToolCall) -> list[dict[str, Any]]:
        name, namespace = self.req.call_name(event.name)
        arguments = json.dumps(event.arguments, ensure_ascii=False)
        item: dict[str, Any] = {"type": "function_call", "id": new_id("fc"),
                                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
                                "arguments": arguments, "status": "completed"}
        if namespace is not None:
            item["namespace"] = namespace
        where = {"item_id": item["id"], "output_index": self._index}
        out = [{"type": "response.output_item.added", "output_index": self._index,
                "item": {**item, "arguments": "", "status": "in_progress"}},
               {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
               {"type": "response.function_call_arguments.done", **where, "name": name,
                "arguments": arguments},
               {"type": "response.output_item.done", "output_index": self._index,
                "item": item}]
        self.items.append(item)
        return out


class ResponsesReply(Reply):
    """One /v1/responses answer: a response object, or its SSE events."""

    def __init__(self, run: ChatRun, req: ResponsesRequest, response_id: str) -> None:
        self.run = run
        self.req = req
        self.delivery = run.req.delivery
        self.id = response_id
        self.created_at = int(time.time())
        self.output = OutputItems(req)
        self.sequence_number = 0

    def items(self) -> AsyncIterator[ChatEvent]:
        return self.run.events()

    @property
    def generation(self) -> Generation:
        return self.run.gen

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        self.run.log_done(finish_reason=finish_reason, error=error)

    def response(self, state: str, **fields: Any) -> dict[str, Any]:
        """The response object in a given state ("in_progress", "completed", ...)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": state, "error": None, "incomplete_details": None,
                "model": self.run.req.model or self.run.state.model_name,
                "output": self.output.items, "previous_response_id": None, "usage": None,
                **self.req.echo, **fields}

    def _final(self) -> dict[str, Any]:
        state, details = status(self.run)
        return self.response(state, incomplete_details=details, usage=usage(self.run))

    async def collect(self) -> dict[str, Any]:
        async for event in self.run.events():
            self.output.add(event)
        self.output.close()
        return self._final()

    def _sse(self, event: dict[str, Any]) -> str:
        event = {"type": event["type"], "sequence_number": self.sequence_number, **event}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        return [self._sse({"type": "response.created", "response": self.response("in_progress")}),
                self._sse({"type": "response.in_progress",
                           "response": self.response("in_progress")})]

    def ping(self) -> str:
        return SSE_PING

    def trailer(self) -> list[str]:  # a comment, as the keep-alives (cache_report.py)
        return cache_comment(self.generation)

    def chunks(self, item: ChatEvent) -> list[str]:
        return [self._sse(e) for e in self.output.add(item)]

    def error(self, err: ApiError) -> list[str]:
        err = with_retry_hint(err)
        failed = self.response("failed", error={"code": failure_code(err),
                                                "message": err.message})
        return [self._sse({"type": "response.failed", "response": failed})]

    def closing(self) -> list[str]:
        out = [self._sse(e) for e in self.output.close()]
        final = self._final()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*out, self._sse({"type": kind, "response": final})]


async def parse_body(state: ServerState, body: dict[str, Any],
                     headers: Any) -> ResponsesRequest:
    """The pipeline's parse step: the list counts first (--max-messages on `input`,
    --max-tools), then the body, then --on-image."""
    check_counts(body, state)
    req = parse_responses_request(body, headers)
    check_replaced(state, req.chat.replaced, req.chat.session)
    return req


async def start_response(state: ServerState, req: ResponsesRequest,
                         hints: SchedulingHints) -> ResponsesReply:
    response_id = new_id("resp")
    run = await prepare_chat(state, req.chat, response_id, api="responses", hints=hints)
    state.metrics.client_sessions.labels(api="responses", source=req.session_source).inc()
    run.gen.log_fields["session_source"] = req.session_source
    run.gen.log_fields["session"] = run.req.session
    if req.tools_left_out:
        run.gen.log_fields["tools_left_out"] = req.tools_left_out
    return ResponsesReply(run, req, response_id)


async def responses(request: Request) -> Response:
    try:
        return await serve(request, parse_body, start_response)
    except ApiError as err:
        raise with_retry_hint(err) from None
