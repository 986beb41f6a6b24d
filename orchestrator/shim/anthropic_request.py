"""Anthropic Messages requests -> ChatRequest: validation and normalisation.

Lenient where Claude Code needs it, strict where a mistake would be silent:

- unknown fields and `anthropic-beta` values are ignored (any 400 makes Claude Code
  retry with features stripped, one by one);
- content blocks the model cannot read are replaced before conversion
  (placeholders.anthropic_readable): images and documents by a stable text placeholder
  (`--on-image reject`: a 400, checked by placeholders.check_replaced), known block types
  the engine cannot act on likewise; an unknown block type is a 400 naming it, as
  Anthropic answers (dropping it would change the prompt without a word);
- `role: "system"` turns inside `messages` are kept where they are;
- `cache_control` is never rendered, and content given as a string or as a list of
  text blocks renders the same, so moving markers do not move the prefix;
- the billing header (first system block) is dropped: it changes every session;
- wrong types, empty `messages` and unknown roles are 400 `invalid_request_error`s that
  say which field.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.shim.chat import (
    ChatRequest,
    ToolChoice,
    header_session_id,
    session_key,
    tool_choice,
)
from orchestrator.shim.chat_template import Message, join_text, split_billing_header
from orchestrator.shim.generation import Delivery
from orchestrator.shim.placeholders import anthropic_readable
from orchestrator.shim.retention import marks as retention_marks
from orchestrator.shim.structured_output import json_grammar
from orchestrator.shim.validate import (
    cache_salt,
    describe,
    invalid,
    is_int64,
    is_positive_int64,
    number,
)
from wire.client import SamplingParams

ROLES = ("user", "assistant", "system")


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = number(body, name, default, "{name}: Input should be a number, got {value}")
    if not lo <= v <= hi:
        raise invalid(f"{name}: must be between {lo:g} and {hi:g}, got {v}", name)
    return float(v)


def _texts(content: Any, where: str) -> list[str]:
    """The texts of a string or a list of blocks (text blocks; what the model cannot
    read has been replaced by text already, placeholders.anthropic_readable)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where}: Input should be a string or a list of content blocks")
    out = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{where}.{i}")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.{i}.text: Input should be a string")
            out.append(text)
    return out


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise invalid(f"{where}: each content block must be an object with a 'type'")
    return block["type"]


def system_messages(system: Any) -> tuple[list[Message], str]:
    """The system prompt as messages, without Claude Code's billing header, and the header
    ("" where there is none; `--billing-header keep` puts it back, chat.normalise)."""
    if system is None:
        return [], ""
    if isinstance(system, str):
        texts = [system]
    else:
        texts = _texts(system, "system")
    texts, header = split_billing_header(texts)
    return ([{"role": "system", "content": join_text(texts)}] if texts else []), header


def _user_messages(content: Any, where: str) -> list[Message]:
    """A user turn: its tool_result blocks become `tool` messages, in order, between
    the user texts before and after them."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: Input should be a string or a list of content blocks")
    out: list[Message] = []
    texts: list[str] = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{where}.content.{i}")
        if kind == "text":
            texts += _texts([block], f"{where}.content")
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": join_text(texts)})
                texts = []
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise invalid(f"{where}.content.{i}.tool_use_id: Field required")
            result = block.get("content")
            result_texts = [] if result is None else _texts(result, f"{where}.content.{i}.content")
            out.append({"role": "tool", "tool_call_id": tool_use_id,
                        "content": join_text(result_texts)})
    if texts or not out:
        out.append({"role": "user", "content": join_text(texts)})
    return out


def _assistant_message(content: Any, where: str) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content: Input should be a string or a list of content blocks")
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{where}.content.{i}")
        if kind == "text":
            texts += _texts([block], f"{where}.content")
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise invalid(f"{where}.content.{i}: tool_use needs a string 'name' and an "
                           "object 'input'")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": name, "arguments": args}})
    msg: Message = {"role": "assistant", "content": join_text(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = join_text(thinking)
    return msg


def convert_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list):
        raise invalid("messages: Input should be a list", "messages")
    if not messages:
        raise invalid("messages: at least one message is required", "messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(f"{where}: Input should be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role: Input should be 'user', 'assistant' or 'system', got "
                       f"{describe(role)}", "messages")
        if "content" not in m:
            raise invalid(f"{where}.content: Field required", "messages")
        if role == "user":
            out += _user_messages(m["content"], where)
        elif role == "assistant":
            out.append(_assistant_message(m["content"], where))
        else:
            out.append({"role": "system",
                        "content": join_text(_texts(m["content"], f"{where}.content"))})
    return out


def convert_tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools in the form HF chat templates expect. Anthropic's server tools
    (typed, without an input_schema: web search, ...) cannot run here and are left out."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools: Input should be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid(f"tools.{i}: each tool needs a string 'name'", "tools")
        schema = tool.get("input_schema")
        if schema is None and tool.get("type") not in (None, "custom"):
            continue
        if not isinstance(schema, dict):
            raise invalid(f"tools.{i}.input_schema: Input should be an object", "tools")
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


_CHOICE_MODES = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """{"type": "auto" | "any" | "tool" | "none", "name": (tool), "disable_parallel_tool_use"}"""
    if choice is None:
        return ToolChoice()
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(kind, str) or kind not in _CHOICE_MODES:
        raise invalid("tool_choice: Input should be an object with type 'auto', 'any', 'tool' "
                   f"or 'none', got {describe(choice)}", "tool_choice")
    name = choice.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise invalid("tool_choice.name: Field required (a string) for type 'tool'", "tool_choice")
    no_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise invalid("tool_choice.disable_parallel_tool_use: Input should be a boolean",
                   "tool_choice")
    return tool_choice(_CHOICE_MODES[kind], name, not no_parallel, tools)


def _thinking(thinking: Any) -> tuple[bool | None, int | None]:
    """`thinking`: {"type": "enabled", "budget_tokens": N} (or "adaptive") turns the
    model's reasoning on where its template can switch it (Qwen3), and caps it at N
    tokens (the engine then ends the span: scheduler/thinking.py); {"type": "disabled"}
    off. Absent: the template's default. (Not off: Qwen3's template ends a prompt
    without thinking in an empty think span that it does not render back, so every
    next turn would miss the prefix cache from the previous answer on.)"""
    if thinking is None:
        return None, None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if not isinstance(kind, str):
        raise invalid(f"thinking: Input should be an object with a 'type', got "
                   f"{describe(thinking)}", "thinking")
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if budget is not None and not is_positive_int64(budget):
        raise invalid("thinking.enabled.budget_tokens: Input should be a positive integer, got "
                   f"{describe(budget)}", "thinking")
    return kind != "disabled", budget


def _output_grammar(body: dict[str, Any]) -> str | None:
    """Structured outputs: `output_config.format` or (beta) `output_format`, each
    {"type": "json_schema", "schema": {...}}. Other output_config fields (effort, ...)
    change nothing here."""
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    param = "output_config.format"
    if fmt is None:
        fmt, param = body.get("output_format"), "output_format"
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise invalid(f"{param}: Input should be an object with type 'json_schema', got "
                   f"{describe(fmt)}", param)
    return json_grammar(fmt.get("schema"), param)


def parse_messages_request(body: dict[str, Any], headers: Any, *,
                           count_only: bool = False) -> ChatRequest:
    """Validate a /v1/messages (or count_tokens) body."""
    body, replaced = anthropic_readable(body)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise invalid(f"model: Input should be a string, got {describe(model)}", "model")
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise invalid("max_tokens: Field required", "max_tokens")
        if not is_positive_int64(max_tokens):
            raise invalid(f"max_tokens: must be a positive integer, got {describe(max_tokens)}",
                       "max_tokens")
    system, billing_header = system_messages(body.get("system"))
    messages = system + convert_messages(body.get("messages"))
    # cache_control: how much of the prompt to keep cached (never part of the prompt)
    marks = retention_marks(body, body["messages"], len(system),
                            lambda upto: len(convert_messages(upto)))
    tools = convert_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    enable_thinking, thinking_budget = _thinking(body.get("thinking"))

    stop = body.get("stop_sequences")
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop_sequences: Input should be a list of strings", "stop_sequences")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int64(top_k) or top_k < 0):
        raise invalid(f"top_k: must be a non-negative integer, got {describe(top_k)}", "top_k")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    sampling = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=top_p if top_p > 0 else 1.0, top_k=top_k or 0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"stream: Input should be a boolean, got {describe(stream)}", "stream")

    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    explicit = header_session_id(headers) or (user_id if isinstance(user_id, str) else None)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        max_tokens=max_tokens,
        sampling=sampling,
        delivery=Delivery(stop=[s for s in stop if s], stream=stream),
        session=session_key(explicit, model, messages, tools),
        model=model,
        grammar=None if count_only else _output_grammar(body),
        enable_thinking=enable_thinking,
        thinking_budget=thinking_budget,
        retention_marks=marks,
        cache_salt=cache_salt(body, "cache_salt: Input should be a non-empty string of at most "
                                    "{limit} characters, got {value}"),
        replaced=replaced,
        billing_header=billing_header,
    )


def tool_input_json(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
