"""OpenAI chat API: `POST /v1/chat/completions`, streaming (data-only SSE ending in
`data: [DONE]`, as OpenAI sends it) or not, with tools and cached-token usage."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from orchestrator.shim.chat import (
    ChatRequest,
    ChatRun,
    ToolChoice,
    session_key,
    start_chat,
    tool_choice,
)
from orchestrator.shim.chat_template import Message, join_text
from orchestrator.shim.errors import ApiError, describe, is_finite_number, is_int64
from orchestrator.shim.generation import Delivery, with_keepalive
from orchestrator.shim.http_common import (
    json_result,
    shim_state,
)
from orchestrator.shim.http_common import sse_response as start_sse
from orchestrator.shim.json_body import loads
from orchestrator.shim.openai_api import SSE_DONE, SSE_PING, sse, usage
from orchestrator.shim.reasoning import Reasoning
from orchestrator.shim.structured_output import json_grammar
from orchestrator.shim.tool_parsers import ToolCall
from wire.client import SamplingParams

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, param=param)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not is_finite_number(v):
        raise _bad(f"'{name}' must be a number, got {describe(v)}", name)
    return float(v)


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}.content' must be a string or a list of parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            kind = part.get("type") if isinstance(part, dict) else describe(part)
            raise _bad(f"'{where}.content': {kind} parts are not supported: this engine "
                       "serves a text-only model", "messages")
        if not isinstance(part.get("text"), str):
            raise _bad(f"'{where}.content': a text part needs a string 'text'", "messages")
        texts.append(part["text"])
    return join_text(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"'{where}.tool_calls' must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"'{where}.tool_calls': each call needs a function name", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends a JSON string; templates want the object
            try:  # held to the body's rules: too deep or a lone surrogate is a 400
                args = loads(args, f"'{where}.tool_calls' arguments") if args.strip() else {}
            except ValueError:
                pass  # not JSON: rendered as the string it is
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def convert_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{where}' must be an object", "messages")
        role = m.get("role")
        role = ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise _bad(f"'{where}.role' must be one of {sorted(ROLES)}, got "
                       f"{describe(m.get('role'))}", "messages")
        msg: Message = {"role": role, "content": _content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def convert_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("'tools': each tool needs {'type': 'function', 'function': {'name'...}}",
                       "tools")
        # as OpenAI checks them: templates concatenate a description, iterate parameters
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"'tools': the description of {fn['name']!r} must be a string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"'tools': the parameters of {fn['name']!r} must be a JSON schema "
                       "object", "tools")
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}},
    and `parallel_tool_calls`."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    choice = "auto" if choice is None else choice  # null: the default, as OpenAI reads it
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice in ("none", "auto", "required"):
        return tool_choice(choice, None, parallel, tools)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(fn, dict) and choice.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                   f"{{'type': 'function', 'function': {{'name': ...}}}}, got {describe(choice)}",
                   "tool_choice")
    return tool_choice("named", fn["name"], parallel, tools)


def _enable_thinking(body: dict[str, Any]) -> bool | None:
    """`chat_template_kwargs.enable_thinking` (as vLLM and SGLang take it): reasoning on
    or off where the template can switch it; None: the template's default."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    value = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else "?"
    if value is not None and not isinstance(value, bool):
        raise _bad("'chat_template_kwargs' must be an object; its 'enable_thinking' a boolean",
                   "chat_template_kwargs")
    return value


def response_format_grammar(body: dict[str, Any]) -> str | None:
    """`response_format`: "text" (None), "json_object" or "json_schema"."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    fields = fmt if isinstance(fmt, dict) else {}
    kind, spec = fields.get("type"), fields.get("json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema" and isinstance(spec, dict):
        return json_grammar(spec.get("schema", {}), "response_format")
    raise _bad("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
               "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
               "response_format")


def parse_chat_request(body: dict[str, Any], headers: Any) -> ChatRequest:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {describe(model)}", "model")
    for name, bad in (("n", body.get("n") not in (None, 1)),
                      ("logprobs", body.get("logprobs") not in (None, False))):
        if bad:
            raise ApiError(f"'{name}' = {describe(body[name])} is not supported", param=name,
                           code="unsupported")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # absent or null: the older name
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not is_int64(max_tokens) or max_tokens < 1):
        raise _bad(f"'max_tokens' must be a positive integer, got {describe(max_tokens)}",
                   "max_tokens")
    temperature, top_p = _number(body, "temperature", 1.0), _number(body, "top_p", 1.0)
    if not 0 <= temperature <= 2:
        raise _bad("'temperature' must be in [0, 2]", "temperature")
    if not 0 < top_p <= 1:
        raise _bad("'top_p' must be in (0, 1]", "top_p")
    top_k, seed = body.get("top_k"), body.get("seed")
    if top_k is not None and (not is_int64(top_k) or top_k < -1):
        raise _bad("'top_k' must be a 64-bit integer >= -1", "top_k")
    if seed is not None and not is_int64(seed):
        raise _bad("'seed' must be a 64-bit integer", "seed")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    messages = convert_messages(body.get("messages"))
    tools = convert_tools(body.get("tools"))
    user = body.get("user") if isinstance(body.get("user"), str) else None
    explicit = headers.get("x-session-id") or headers.get("x-claude-code-session-id") or user
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p,
                                top_k=max(top_k or 0, 0), seed=seed),
        delivery=Delivery(stop=[s for s in stop if s], stream=stream,
                          include_usage=options.get("include_usage") is True),
        session=session_key(explicit, model, messages, tools),
        model=model,
        grammar=response_format_grammar(body),
        enable_thinking=_enable_thinking(body),
        thinking_budget=_thinking_budget(body),
    )


def _thinking_budget(body: dict[str, Any]) -> int | None:
    """`thinking_token_budget` (vLLM's name): reasoning tokens before the engine ends the
    span (scheduler/thinking.py)."""
    budget = body.get("thinking_token_budget")
    if budget is not None and (not is_int64(budget) or budget < 1):
        raise _bad(f"'thinking_token_budget' must be a positive integer, got {describe(budget)}",
                   "thinking_token_budget")
    return budget


def _finish_reason(run: ChatRun) -> str:
    """A whole tool call wins over a length cut after it (as in stop_reason)."""
    if run.num_tool_calls:
        return "tool_calls"
    return "length" if run.gen.finish_reason == "length" else "stop"


def _tool_call(event: ToolCall, index: int | None = None) -> dict[str, Any]:
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": event.name,
                         "arguments": json.dumps(event.arguments, ensure_ascii=False)}}
    return call if index is None else {"index": index, **call}


def _usage(run: ChatRun) -> dict[str, Any]:
    counts = usage(run.gen.num_prompt_tokens, len(run.gen.token_ids), run.gen.num_cached)
    counts["completion_tokens_details"] = {"reasoning_tokens": run.gen.num_reasoning_tokens}
    return counts


async def collect(run: ChatRun, base: dict[str, Any]) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    async for event in run.events():
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
              "finish_reason": _finish_reason(run)}
    return {**base, "object": "chat.completion", "choices": [choice], "usage": _usage(run)}


async def stream(run: ChatRun, base: dict[str, Any], ping_interval_s: float) -> AsyncIterator[str]:
    """The streaming response. Its first chunk (the role) comes with the first output,
    or after `ping_interval_s` without one (an engine error before it is still an HTTP
    error status); then an SSE comment each `ping_interval_s` without output, so that
    proxies and clients with read timeouts wait through a queue, a long prefill or a
    tool call the parser holds until it is whole. OpenAI clients skip comment lines."""
    base = {**base, "object": "chat.completion.chunk"}
    with_usage = run.req.delivery.include_usage

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        c = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}]}
        if with_usage:
            c["usage"] = None  # as OpenAI: null on all chunks but the last
        return sse(c)

    keepalive = with_keepalive(run.events(), ping_interval_s)
    started = False
    num_calls = 0
    try:
        async for event in keepalive:
            if not started:
                started = True
                yield chunk({"role": "assistant", "content": ""})
            elif event is None:
                yield SSE_PING
            if event is None:
                continue
            if isinstance(event, ToolCall):
                yield chunk({"tool_calls": [_tool_call(event, num_calls)]})
                num_calls += 1
            elif event.text:
                key = "reasoning_content" if isinstance(event, Reasoning) else "content"
                yield chunk({key: event.text})
    except ApiError as err:
        run.log_done(finish_reason="error", error=err.message)
        if not started:
            raise
        yield sse(err.body())
        yield SSE_DONE
        return
    finally:
        await keepalive.aclose()  # and the events with it
        run.log_done()
    if not started:
        yield chunk({"role": "assistant", "content": ""})
    yield chunk({}, _finish_reason(run))
    if with_usage:
        yield sse({**base, "choices": [], "usage": _usage(run)})
    yield SSE_DONE


async def chat_completions(request: Request) -> Response:
    state = shim_state(request)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    req, run = await start_chat(request, parse_chat_request, request_id, api="chat")
    base = {"id": request_id, "created": int(time.time()), "model": req.model or state.model_name}
    if not req.delivery.stream:
        return await json_result(request, collect(run, base), run.log_done)
    return await start_sse(request, stream(run, base, state.ping_interval_s), run.log_done)
