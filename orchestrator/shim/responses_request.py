"""OpenAI Responses requests (`POST /v1/responses`, what Codex CLI speaks) -> ChatRequest,
so they run on the chat pipeline like the other APIs (chat.py renders them).

Input items become chat messages:

    message               developer / system -> system; user; assistant (parts input_text,
                          output_text, text, refusal; or a plain string)
    reasoning             its reasoning_text content (else its summary_text) -> the
                          reasoning_content of the assistant turn it opens (a template
                          that renders no reasoning drops it, on every request alike)
    function_call         a tool call of the assistant turn ({call_id, name, arguments}:
                          a JSON object in a string)
    function_call_output  a tool message (its call_id must name an earlier function_call)

Consecutive assistant-side items (reasoning, assistant messages, function calls: one
answer as this server streamed it) make one assistant message, as the chat API sends it,
so a turn renders back to the tokens the model wrote. `instructions` is a first system
message; `input` may be a plain string (one user message).

Only what the model reads is read: item `id`s, `status`, `annotations`, `logprobs`,
`encrypted_content` and any other field never reach the prompt (two Codex sessions'
first requests differ only in item ids: rendering them would miss the cache from token 0).

Tools: `function` tools (`strict` accepted: a schema is not enforced unless a call is
forced) and `namespace` tools, whose functions the model sees as `NAMESPACE.NAME` (one
flat list); a call to one comes back as a function_call with `name` NAME and `namespace`
NAMESPACE (OpenAI's fields), and such an item sent back renders as NAMESPACE.NAME again.
The namespace's own description is not rendered. Hosted tools (web search, file search,
code interpreter, custom/freeform tools, ...) cannot run here and are left out, as the
Messages API leaves out Anthropic's server tools; an unknown tool type is a 400.

Stateless only: `store` is accepted and ignored (nothing is stored; GET
/v1/responses/{id} is not served), and `previous_response_id`, `conversation`,
`background` and `prompt` are a 400 that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
from orchestrator.shim.openai_request import CACHE_SALT_ERROR
from orchestrator.shim.openai_sampling import sampling_params
from orchestrator.shim.placeholders import Replaced, responses_part
from orchestrator.shim.retention import marks as retention_marks
from orchestrator.shim.structured_output import json_grammar
from orchestrator.shim.validate import cache_salt, describe, invalid, is_positive_int64

ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# Hosted tools: OpenAI runs them on its side; here there is nothing to run them.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11",
    "web_search_2025_08_26", "file_search", "code_interpreter", "image_generation",
    "computer", "computer_use_preview", "mcp", "local_shell", "shell", "apply_patch",
    "custom", "tool_search",
})
NOT_SERVED = {  # stateful features: nothing is stored here
    "previous_response_id": "responses are not stored on this server: send the whole "
                            "conversation in 'input' (as Codex does with store: false)",
    "conversation": "conversations are not stored on this server: send the whole "
                    "conversation in 'input'",
    "prompt": "stored prompt templates are not served here: send 'instructions' and 'input'",
}
SEPARATOR = "."  # between a namespace and its function's name, as the model sees them


@dataclass
class ResponsesRequest:
    """A /v1/responses request: the chat request it runs as, and what its response
    echoes or maps back."""

    chat: ChatRequest
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (ns, name)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    tools_left_out: list[str] = field(default_factory=list)  # hosted tool types
    session_source: str = "none"  # "prompt_cache_key", "session-id" or "none"

    def call_name(self, flat: str) -> tuple[str, str | None]:
        """A call's (name, namespace) as the client declared it."""
        if flat in self.namespaced:
            namespace, name = self.namespaced[flat]
            return name, namespace
        return flat, None


# --- input items -> messages ---------------------------------------------------------


def _text(content: Any, where: str, replaced: list[Replaced]) -> str:
    """A message's content: a string, or text parts joined as the chat APIs join them
    (media parts become placeholders first)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        part = responses_part(part, f"{where}.content[{j}]", replaced)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            raise invalid(f"'{where}.content[{j}]': unknown content part type "
                          f"{describe(kind)}", "input")
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{where}.content[{j}]': a text part needs a string 'text'", "input")
        texts.append(part["text"])
    return join_text(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content (reasoning_text parts, as this server sends
    them), else its summary; an item with neither (only encrypted_content) adds nothing."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise invalid(f"'{where}.{key}' must be a list of parts with a string 'text'",
                          "input")
        if parts:
            return join_text([p["text"] for p in parts])
    return ""


def _arguments(item: dict[str, Any], where: str) -> dict[str, Any]:
    raw = item.get("arguments")
    if not isinstance(raw, str):
        raise invalid(f"'{where}.arguments' must be a string (the arguments as JSON), got "
                      f"{describe(raw)}", "input")
    try:
        args = loads(raw, f"'{where}.arguments'") if raw.strip() else {}
    except ValueError:
        raise invalid(f"'{where}.arguments' is not valid JSON: {raw[:40]!r}", "input") from None
    if not isinstance(args, dict):
        raise invalid(f"'{where}.arguments' must be a JSON object, got {describe(args)}",
                      "input")
    return args


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"'{where}.{name}' must be a non-empty string, got {describe(value)}",
                      "input")
    return value


class _Conversation:
    """Messages built item by item; an assistant turn stays open for the items of the
    same answer."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.call_ids: set[str] = set()
        self.replaced: list[Replaced] = []

    def assistant(self) -> Message:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        return last

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an object, got {describe(item)}", "input")
        kind = item.get("type")
        if kind is None and "role" in item:  # the short form of a message
            kind = "message"
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                turn = self.assistant()
                turn["reasoning_content"] = join_text(
                    [t for t in (turn.get("reasoning_content"), text) if t])
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in self.call_ids:
                raise invalid(f"'{where}': no function_call with call_id {call_id!r} before "
                              "this function_call_output", "input")
            output = _text(item.get("output"), where, self.replaced)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "item_reference":
            raise invalid(f"'{where}': item references need stored responses, which this "
                          "server does not keep: send the item itself", "input")
        else:
            raise invalid(f"'{where}': unsupported input item type {describe(kind)} (this "
                          "server reads message, reasoning, function_call and "
                          "function_call_output)", "input")

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        role = ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}, got "
                          f"{describe(item.get('role'))}", "input")
        text = _text(item.get("content"), where, self.replaced)
        if role != "assistant":
            self.messages.append({"role": role, "content": text})
            return
        turn = self.assistant()
        turn["content"] = join_text([t for t in (turn["content"], text) if t])

    def _call(self, item: dict[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        name = _string(item, "name", where)
        namespace = item.get("namespace")
        if namespace is not None:
            if not isinstance(namespace, str) or not namespace:
                raise invalid(f"'{where}.namespace' must be a non-empty string", "input")
            name = f"{namespace}{SEPARATOR}{name}"
        turn = self.assistant()
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": _arguments(item, where)}})
        self.call_ids.add(call_id)


def convert_input(instructions: Any, items: Any) -> tuple[list[Message], list[Replaced]]:
    """`instructions` and `input` as chat messages (and the media parts replaced)."""
    conversation = _Conversation()
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid(f"'instructions' must be a string, got {describe(instructions)}",
                          "instructions")
        if instructions:
            conversation.messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty list of items or a string", "input")
    for i, item in enumerate(items):
        conversation.add(item, f"input[{i}]")
    return conversation.messages, conversation.replaced


# --- tools ---------------------------------------------------------------------------


def _function(tool: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}': a function tool needs a string 'name'", "tools")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{where}': the description of {name!r} must be a string", "tools")
    parameters = tool.get("parameters")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise invalid(f"'{where}': the parameters of {name!r} must be a JSON schema object",
                      "tools")
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"'{where}.strict' must be a boolean", "tools")
    function: dict[str, Any] = {"name": prefix + name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def convert_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]],
                                       list[str]]:
    """(the tools in HF's format, flat name -> (namespace, name), hosted types left out)."""
    if tools is None:
        return [], {}, []
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    out: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    left_out: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
                raise invalid(f"'{where}': a namespace tool needs a string 'name' and a list "
                              "'tools'", "tools")
            for j, nested in enumerate(inner):
                nested_kind = nested.get("type") if isinstance(nested, dict) else None
                if nested_kind != "function":
                    left_out.append(f"{namespace}:{nested_kind}")
                    continue
                fn = _function(nested, f"{where}.tools[{j}]", namespace + SEPARATOR)
                out.append(fn)
                namespaced[fn["function"]["name"]] = (namespace, nested["name"])
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:
            left_out.append(kind)
        else:
            raise invalid(f"'{where}': unsupported tool type {describe(kind)} (this server "
                          "runs function and namespace tools)", "tools")
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise invalid(f"'tools': two tools are named {dup!r}", "tools")
    return out, namespaced, left_out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "name", "namespace"?}, and
    `parallel_tool_calls`."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    choice = "auto" if choice is None else choice
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice in ("none", "auto", "required"):
        return tool_choice(choice, None, parallel, tools)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        namespace = choice.get("namespace")
        name = choice["name"] if not isinstance(namespace, str) else (
            f"{namespace}{SEPARATOR}{choice['name']}")
        return tool_choice("named", name, parallel, tools)
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                  f"'name': ...}}, got {describe(choice)}", "tool_choice")


# --- the body ------------------------------------------------------------------------


def _text_format_grammar(body: dict[str, Any]) -> str | None:
    """`text.format`: {"type": "text"} (None), {"type": "json_object"} or
    {"type": "json_schema", "name", "schema"}."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else "?"
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "text.format")
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return json_grammar(fmt["schema"], "text.format")
    raise invalid("'text' must be an object whose 'format' is {'type': 'text'}, {'type': "
                  "'json_object'} or {'type': 'json_schema', 'name': ..., 'schema': {...}}",
                  "text")


def _refuse_stateful(body: dict[str, Any]) -> None:
    for name, why in NOT_SERVED.items():
        if body.get(name) is not None:
            raise ApiError(f"'{name}' is not supported: {why}", param=name, code="unsupported")
    if body.get("background") not in (None, False):
        raise ApiError("'background' is not supported: responses are streamed or returned, "
                       "never stored to poll", param="background", code="unsupported")
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(f"'{name}' must be a boolean, got {describe(body[name])}", name)
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError(f"'top_logprobs' = {describe(body['top_logprobs'])} is not supported",
                       param="top_logprobs", code="unsupported")


def _session(body: dict[str, Any], headers: Any) -> tuple[str | None, str]:
    """The client's session id and where it came from: `prompt_cache_key` (Codex's
    session id, stable across `resume`), else the `session-id` header."""
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise invalid(f"'prompt_cache_key' must be a string, got {describe(key)}",
                      "prompt_cache_key")
    if key:
        return key, "prompt_cache_key"
    header = header_session_id(headers)
    return (header, "session-id") if header else (None, "none")


def parse_responses_request(body: dict[str, Any], headers: Any) -> ResponsesRequest:
    """Validate a /v1/responses body (ApiError, 400 in OpenAI's shape, if anything is
    wrong)."""
    model = body.get("model", "")
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {describe(model)}", "model")
    _refuse_stateful(body)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and not is_positive_int64(max_tokens):
        raise invalid("'max_output_tokens' must be a positive integer, got "
                      f"{describe(max_tokens)}", "max_output_tokens")
    sampling = sampling_params(body)  # the chat and completions validator
    messages, replaced = convert_input(body.get("instructions"), body.get("input"))
    tools, namespaced, left_out = convert_tools(body.get("tools"))
    items = body["input"] if isinstance(body["input"], list) else []
    num_system = 1 if body.get("instructions") else 0
    marks = retention_marks(body, items, num_system,
                            lambda upto: len(convert_input(None, upto)[0]) if upto else 0)
    explicit, source = _session(body, headers)
    chat = ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        max_tokens=max_tokens,
        sampling=sampling,
        delivery=Delivery(stream=body.get("stream") is True),
        session=session_key(explicit, model, messages, tools),
        cache_salt=cache_salt(body, CACHE_SALT_ERROR),
        replaced=replaced,
        model=model,
        grammar=_text_format_grammar(body),
        retention_marks=marks,
    )
    echo = {name: body.get(name) for name in (
        "instructions", "max_output_tokens", "metadata", "reasoning", "temperature", "top_p",
        "user", "prompt_cache_key")}
    echo["text"] = body.get("text") or {"format": {"type": "text"}}
    echo["truncation"] = body.get("truncation") or "disabled"
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = chat.tool_choice.parallel
    echo["store"] = False  # whatever was asked: nothing is kept
    return ResponsesRequest(chat, namespaced, echo, left_out, source)
