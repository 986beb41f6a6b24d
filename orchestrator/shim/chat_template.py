"""Chat prompts: the model's own jinja2 chat template, rendered the way Hugging Face
renders it, from messages normalised so that the same conversation always gives the
same text.

The API modules turn their requests into plain messages first:

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str,                                   # always one string
     "tool_calls": [{"id", "type": "function",
                     "function": {"name", "arguments": dict}}],   # assistant only
     "tool_call_id": str,                              # tool only
     "reasoning_content": str}                         # assistant, optional

and tools as `{"type": "function", "function": {"name", "description", "parameters"}}`
(what HF templates expect). Prefix stability rests on three rules applied here and by
the API modules: content is always one string (a list of text blocks on one request
and a string on the next render the same), markers such as `cache_control` never reach
the template, and Claude Code's per-session billing header is dropped.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrator.shim.errors import ApiError

# Claude Code's first system block: `x-anthropic-billing-header: cc_version=...; ...`,
# different in every session. Rendered, it would make every new session miss at token 0.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
# Appended to the last message to find where its text ends in the rendered prompt.
_CONTINUE_TAG = "\x00DEEPINFER_CONTINUE\x00"

Message = dict[str, Any]


def join_text(parts: list[str]) -> str:
    """The one string a list of text blocks becomes (a single block is its own text, so
    `"hi"` and `[{"type": "text", "text": "hi"}]` render the same)."""
    return "\n".join(parts)


def split_billing_header(texts: list[str]) -> tuple[list[str], str]:
    """System texts without Claude Code's billing header (a block, or a first line), and
    the header ("" where there is none)."""
    out, header = [], ""
    for i, text in enumerate(texts):
        if i == 0 and text.lstrip().startswith(BILLING_HEADER_PREFIX):
            header, _, rest = text.lstrip().partition("\n")
            if not rest.strip():
                continue
            text = rest
        out.append(text)
    return out, header


def strip_billing_header(texts: list[str]) -> list[str]:
    """System texts without Claude Code's billing header."""
    return split_billing_header(texts)[0]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping, keys in the order given (jinja2's sorts them).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# What a template raises on a conversation it cannot take: its own raise_exception, or
# an operation on a value of a type it did not expect (a client's odd but valid JSON,
# e.g. `"..." + tool.description` with a list): the client's to fix, a 400, not a 500.
RENDER_ERRORS = (jinja2.exceptions.TemplateError, TypeError, ValueError, AttributeError,
                 KeyError, IndexError)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment HF's apply_chat_template uses (templates are written for it)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A model's chat template, compiled once."""

    def __init__(self, template: str, *, tool_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        env = _environment()
        self.source = template
        self._template = env.from_string(template)
        self._tool_template = env.from_string(tool_template) if tool_template else None
        self.special_tokens = special_tokens or {}

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> ChatTemplate | None:
        """The template in tokenizer_config.json (or chat_template.jinja); None if the
        model has none."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        tool_template = None
        if isinstance(template, list):  # named templates: "default", "tool_use", ...
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template, tool_template = named.get("default"), named.get("tool_use")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if not isinstance(template, str):
            return None
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(name))
            if text is not None:
                special[name] = text
        return cls(template, tool_template=tool_template, special_tokens=special)

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
               *, add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
        """The prompt text. A conversation ending with an assistant message is continued
        (its text is the start of the answer: Anthropic's prefill), with no generation
        prompt. A template that refuses a system message after the first (most accept
        them) gets it as a user message instead. `enable_thinking`, when given, goes to
        the template (Qwen3's switches its reasoning on or off with it; others ignore it)."""
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            return self._render(messages, tools, add_generation_prompt, extra)
        except RENDER_ERRORS as exc:
            late_system = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
            if not late_system:
                raise ApiError(f"the chat template refused the conversation: {exc}") from None
            messages = [{**m, "role": "user"} if i in late_system else m
                        for i, m in enumerate(messages)]
            try:
                return self._render(messages, tools, add_generation_prompt, extra)
            except RENDER_ERRORS as exc2:
                raise ApiError(f"the chat template refused the conversation: {exc2}") from None

    def _render(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        template = self._tool_template if tools and self._tool_template else self._template
        last = messages[-1] if messages else None
        continue_final = (last is not None and last["role"] == "assistant"
                          and not last.get("tool_calls") and bool(last.get("content")))
        if continue_final:
            messages = [*messages[:-1], {**last, "content": last["content"] + _CONTINUE_TAG}]
        text = template.render(messages=messages, tools=tools or None,
                               add_generation_prompt=add_generation_prompt and not continue_final,
                               **self.special_tokens, **extra)
        if continue_final:
            cut = text.rfind(_CONTINUE_TAG)
            if cut < 0:
                raise ApiError("the chat template dropped the final assistant message, so it "
                               "cannot be continued")
            text = text[:cut]
        return text
