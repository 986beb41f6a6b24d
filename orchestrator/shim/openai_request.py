"""OpenAI requests -> what the shim serves: `POST /v1/chat/completions` bodies become a
ChatRequest (chat.py renders it), `POST /v1/completions` bodies a GenerateRequest and
its Delivery. Validation is small explicit code rather than a schema library so that
types are strict (`"5"` and `true` are not integers) and every error is an `ApiError`
rendered in OpenAI's shape, never a framework's default.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from orchestrator.shim.chat import (
    ChatRequest,
    ToolChoice,
    header_session_id,
    session_key,
    tool_choice,
)
from orchestrator.shim.chat_template import Message, join_text
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Delivery
from orchestrator.shim.json_body import loads
from orchestrator.shim.openai_sampling import sampling_params
from orchestrator.shim.placeholders import openai_readable
from orchestrator.shim.retention import marks as retention_marks
from orchestrator.shim.retention import ttl_of
from orchestrator.shim.state import ServerState, tokenize
from orchestrator.shim.structured_output import json_grammar
from orchestrator.shim.validate import (
    all_int64,
    cache_salt,
    describe,
    invalid,
    is_int64,
    is_positive_int64,
)
from wire.client import GenerateRequest, Retention

T = TypeVar("T")

# --- /v1/chat/completions -------------------------------------------------------------


CACHE_SALT_ERROR = "'cache_salt' must be a non-empty string of at most {limit} characters"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or a list of parts", "messages")
    texts = []
    for part in content:  # text parts only: placeholders.openai_readable replaced the rest
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            raise invalid(f"'{where}.content': each part must be an object with a 'type', "
                       f"got {describe(part)}", "messages")
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{where}.content': a text part needs a string 'text'", "messages")
        texts.append(part["text"])
    return join_text(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(f"'{where}.tool_calls' must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"'{where}.tool_calls': each call needs a function name", "messages")
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
        raise invalid("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{where}' must be an object", "messages")
        role = m.get("role")
        role = ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}, got "
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
        raise invalid("'tools' must be a list", "tools")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid("'tools': each tool needs {'type': 'function', 'function': {'name'...}}",
                       "tools")
        # as OpenAI checks them: templates concatenate a description, iterate parameters
        if not isinstance(fn.get("description", ""), str):
            raise invalid(f"'tools': the description of {fn['name']!r} must be a string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid(f"'tools': the parameters of {fn['name']!r} must be a JSON schema "
                       "object", "tools")
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}},
    and `parallel_tool_calls`."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    choice = "auto" if choice is None else choice  # null: the default, as OpenAI reads it
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice in ("none", "auto", "required"):
        return tool_choice(choice, None, parallel, tools)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(fn, dict) and choice.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
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
        raise invalid("'chat_template_kwargs' must be an object; its 'enable_thinking' a boolean",
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
    raise invalid("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
               "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
               "response_format")


def parse_chat_request(body: dict[str, Any], headers: Any) -> ChatRequest:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {describe(model)}", "model")
    if body.get("logprobs") not in (None, False):
        raise ApiError(f"'logprobs' = {describe(body['logprobs'])} is not supported",
                       param="logprobs", code="unsupported")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # absent or null: the older name
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and not is_positive_int64(max_tokens):
        raise invalid(f"'max_tokens' must be a positive integer, got {describe(max_tokens)}",
                   "max_tokens")
    sampling = sampling_params(body)  # as /v1/completions reads them
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    readable, replaced = openai_readable(body.get("messages"))
    messages = convert_messages(readable)
    tools = convert_tools(body.get("tools"))
    # cache_control on messages or their parts (OpenRouter's form), or top-level
    marks = retention_marks(body, body["messages"], 0, lambda upto: len(upto))
    user = body.get("user") if isinstance(body.get("user"), str) else None
    explicit = header_session_id(headers) or user
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        max_tokens=max_tokens,
        sampling=sampling,
        delivery=Delivery(stop=[s for s in stop if s], stream=stream,
                          include_usage=options.get("include_usage") is True),
        session=session_key(explicit, model, messages, tools),
        cache_salt=cache_salt(body, CACHE_SALT_ERROR),
        replaced=replaced,
        model=model,
        grammar=response_format_grammar(body),
        enable_thinking=_enable_thinking(body),
        thinking_budget=_thinking_budget(body),
        retention_marks=marks,
    )


def _thinking_budget(body: dict[str, Any]) -> int | None:
    """`thinking_token_budget` (vLLM's name): reasoning tokens before the engine ends the
    span (scheduler/thinking.py)."""
    budget = body.get("thinking_token_budget")
    if budget is not None and not is_positive_int64(budget):
        raise invalid(f"'thinking_token_budget' must be a positive integer, got {describe(budget)}",
                   "thinking_token_budget")
    return budget


# --- /v1/completions ------------------------------------------------------------------


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


_KINDS: dict[type, tuple[str, Any]] = {
    int: ("a 64-bit integer", is_int64),
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _opt(body: dict[str, Any], name: str, kind: type[T], default: T) -> T:
    """body[name] if present and not null, checked to be of `kind`; else `default`."""
    v = body.get(name)
    if v is None:
        return default
    what, check = _KINDS[kind]
    if not check(v):
        raise ApiError(f"'{name}' must be {what}, got {json.dumps(v)[:40]}", param=name)
    return kind(v)  # type: ignore[call-arg]


def _stop_strings(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise ApiError("'stop' must be a string or a list of strings", param="stop")


def _token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all_int64(v):
        raise ApiError(f"'{name}' must be a list of integers", param=name)
    if v and (min(v) < 0 or max(v) >= vocab_size):  # in C; the culprit only if needed
        bad = next(t for t in v if not 0 <= t < vocab_size)
        raise ApiError(
            f"token id {bad} in '{name}' is out of range [0, {vocab_size})", param=name
        )
    return v


def prompt_input(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a request: a string or a list of token ids (not yet range-checked).

    OpenAI also accepts a batch (a list of strings or of id lists); one element is
    unwrapped, several are refused: one request, one sequence, one stream.
    """
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > 1:
            raise ApiError("several prompts in one request are not supported; send one "
                           "request per prompt", param="prompt", code="unsupported")
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all_int64(p):
        return p
    raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")


def parse_completion(
    body: dict[str, Any], prompt_token_ids: list[int], *, vocab_size: int, max_model_len: int,
    max_output_tokens: int = 0, request_id: str = "", session: str | None = None,
) -> tuple[GenerateRequest, Delivery]:
    """Validate a /v1/completions body whose prompt (see `prompt_input`) is already
    tokenized to `prompt_token_ids`: the request for the engine, and what the shim does
    with its output. Raises ApiError for anything the engine must not see.
    `max_output_tokens` > 0: the server's cap on any request's output (--max-output-tokens).
    `session`: the client's session id (`completion_session`), for the engine's session
    retention and miss reasons; None: the engine tells sessions by their prefixes.
    """
    _opt(body, "model", str, "")  # any name is served (agents send their own); type only
    _refuse_unsupported(body)

    prompt_token_ids = _token_ids(prompt_token_ids, "prompt", vocab_size)
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise ApiError("the prompt is empty", param="prompt")
    if n_prompt >= max_model_len:
        tail = "" if n_prompt > max_model_len else ", which leaves no room for the completion"
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt} tokens in the prompt{tail}. Please reduce the length of "
            "the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = _opt(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    # Clamp, as vLLM does: a request for more than fits simply stops at the context end.
    max_tokens = min(max_tokens, max_model_len - n_prompt)
    if max_output_tokens > 0:
        max_tokens = min(max_tokens, max_output_tokens)

    sampling = sampling_params(body)  # as /v1/chat/completions reads them

    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        stop_token_ids = _token_ids(stop_token_ids, "stop_token_ids", vocab_size)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")

    stop = _stop_strings(body)
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=stop_token_ids or [],
        ignore_eos=_opt(body, "ignore_eos", bool, False),
        cache_salt=cache_salt(body, CACHE_SALT_ERROR),
        session_id=session,
        # a top-level cache_control keeps the whole prompt (orchestrator/shim/retention.py)
        retention=[Retention(len(prompt_token_ids), ttl) for ttl in
                   [ttl_of(body.get("cache_control"), "body")] if ttl is not None],
    )
    delivery = Delivery(
        stop=stop,
        stream=_opt(body, "stream", bool, False),
        include_usage=_opt(stream_options or {}, "include_usage", bool, False),
    )
    return request, delivery


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Options we do not implement are refused when set, never silently ignored (those
    both endpoints have, n, the penalties and logit_bias, in openai_sampling)."""
    unsupported = {
        "best_of": body.get("best_of") not in (None, 1),
        "echo": body.get("echo") not in (None, False),
        "logprobs": body.get("logprobs") is not None,
        "suffix": body.get("suffix") is not None,
    }
    for name, is_set in unsupported.items():
        if is_set:
            value = json.dumps(body[name])[:40]
            raise ApiError(f"'{name}' = {value} is not supported", param=name,
                           code="unsupported")


async def parse_completion_body(state: ServerState, body: dict[str, Any],
                                headers: Any) -> tuple[GenerateRequest, Delivery]:
    """The pipeline's parse step for /v1/completions: the prompt is tokenized first
    (its length and ids are checked against the model)."""
    prompt = prompt_input(body)
    ids = await tokenize(state.tokenizer, prompt) if isinstance(prompt, str) else prompt
    return parse_completion(body, ids, vocab_size=state.vocab_size,
                            max_model_len=state.max_model_len,
                            max_output_tokens=state.options.max_output_tokens,
                            session=completion_session(body, headers))


def completion_session(body: dict[str, Any], headers: Any) -> str | None:
    """A /v1/completions request's session: a session header, else the body's `user`,
    keyed by the model name as the chat endpoints key theirs; None if neither is sent."""
    user = body.get("user") if isinstance(body.get("user"), str) else None
    explicit = header_session_id(headers) or user
    return f"{body.get('model', '')}|{explicit}" if explicit else None
