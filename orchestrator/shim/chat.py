"""The part of a chat request the chat APIs share (Anthropic Messages, OpenAI chat and
Responses): render the conversation, tokenize it so the session's prefix keeps matching,
check it fits, and turn the engine's text into reasoning, text and tool-call events.

    body -> parse_chat(API parse) -> ChatRequest -> prepare_chat() -> ChatRun
    ChatRun.events(): ChatEvent (Reasoning | TextEvent | ToolCall), then the turn is recorded
    (the API's response module formats the events; pipeline.serve drives the steps)

tool_choice is applied here, the same way for every API: "none" leaves calls as text;
"required" or a named tool appends the start of a call to the prompt (the parser's
`opening`) and a grammar holds the rest to the tool's schema, so the answer is a call;
without parallel calls the answer ends at the first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from orchestrator.shim.admission import SchedulingHints, check_counts
from orchestrator.shim.chat_template import Message
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Delivery, Generation
from orchestrator.shim.pipeline import Parse
from orchestrator.shim.placeholders import Replaced, check_replaced
from orchestrator.shim.reasoning import Answer, Reasoning, make_splitter, opens_in
from orchestrator.shim.retention import RetentionMark, retention
from orchestrator.shim.state import TOKENIZE_IN_THREAD_CHARS, ServerState, tokenize
from orchestrator.shim.structured_output import after_reasoning, tool_call_grammar
from orchestrator.shim.tenants import salted, tenant_session
from orchestrator.shim.tool_parsers import TextEvent, ToolCall, ToolParser, make_tool_parser
from wire.client import GenerateRequest, Retention, SamplingParams, ThinkingSpan

log = structlog.get_logger()

NO_HINTS = SchedulingHints()
ChatEvent = TextEvent | ToolCall | Reasoning  # what a chat answer is made of, in order


@dataclass
class ToolChoice:
    """What the client allows: "auto" (the model decides), "none" (no calls: all text),
    "required" (a call to any tool) or "named" (a call to `name`). `parallel`: False
    ends the answer at its first call."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


def tool_choice(mode: str, name: str | None, parallel: bool,
                tools: list[dict[str, Any]]) -> ToolChoice:
    """A ToolChoice checked against the request's tools (HF format); the API modules
    parse their own shapes into (mode, name, parallel)."""
    names = [t["function"]["name"] for t in tools]
    if mode in ("required", "named") and not names:
        raise ApiError("tool_choice: a tool call was required, but the request has no tools",
                       param="tool_choice")
    if mode == "named" and name not in names:
        raise ApiError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    if mode == "required" and len(names) == 1:
        mode, name = "named", names[0]
    return ToolChoice(mode, name if mode == "named" else None, parallel)


@dataclass
class ChatRequest:
    """A chat request in API-neutral form (the API modules build it)."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # HF format
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    max_tokens: int | None = None  # None: all the room left
    sampling: SamplingParams = field(default_factory=SamplingParams)
    delivery: Delivery = field(default_factory=Delivery)  # stop strings, stream, usage
    session: str = ""
    cache_salt: str | None = None  # the request's own; its key's tenant is added (tenants.py)
    replaced: list[Replaced] = field(default_factory=list)  # blocks now placeholders
    model: str = ""  # as the client named it
    grammar: str | None = None  # the answer's format (response_format, output_format)
    enable_thinking: bool | None = None  # to the chat template; None: its default
    thinking_budget: int | None = None  # reasoning tokens before the span is ended
    retention_marks: list[RetentionMark] = field(default_factory=list)  # cache_control
    billing_header: str = ""  # Claude Code's, taken out of the system prompt (normalise)


# The headers a client names its session in, the first one present counts: Claude Code's,
# opencode's and Codex's own, and `x-session-affinity`, which routers in front of several
# engines set (the session's id, whatever the API).
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id",
                   "x-session-affinity")


def header_session_id(headers: Any) -> str | None:
    """The session id the request's headers carry (SESSION_HEADERS), if any."""
    return next((v for v in map(headers.get, SESSION_HEADERS) if v), None)


def session_key(explicit: str | None, model: str, messages: list[Message],
                tools: list[dict[str, Any]]) -> str:
    """The prefix tracker's session: the client's session id if it sent one, else a
    digest of the conversation's start (system prompt, first turn, tool names)."""
    if explicit:
        return f"{model}|{explicit}"
    first_turn = next((i for i, m in enumerate(messages) if m["role"] != "system"), 0)
    head = [m.get("content", "") for m in messages[: first_turn + 1]]
    names = [t.get("function", {}).get("name") for t in tools]
    digest = hashlib.blake2b(json.dumps([head, names]).encode(), digest_size=8).hexdigest()
    return f"{model}|conv-{digest}"


@dataclass
class ChatPrompt:
    text: str  # the rendered conversation, then `forced`
    token_ids: list[int]
    forced: str = ""  # the start of a tool call that tool_choice requires
    grammar: str | None = None  # what the answer must follow (structured_output.py)
    retention: list[Retention] = field(default_factory=list)  # from the cache_control marks


@dataclass
class ForcedCall:
    opening: str = ""  # the start of the call, appended to the prompt
    grammar: str | None = None  # what the answer may add to it


def forced_call(state: ServerState, req: ChatRequest) -> ForcedCall:
    """The call tool_choice requires, if any: its start goes after the generation prompt
    (the tool parser's opening, as Anthropic prefills) and the grammar holds the rest to
    the tool's input schema."""
    choice = req.tool_choice
    if choice.mode not in ("required", "named"):
        return ForcedCall()
    parser = make_tool_parser(state.options.tool_call_parser, req.tools)
    opening = parser.opening(choice.name)
    if opening is None:
        raise ApiError("tool_choice cannot require a tool call: this server does not parse "
                       f"them (--tool-call-parser {state.options.tool_call_parser})",
                       param="tool_choice")
    return ForcedCall(opening, tool_call_grammar(req.tools, choice.name, parser.opening,
                                                 parser.call_format))


async def render_prompt(state: ServerState, req: ChatRequest) -> str:
    if state.chat_template is None:
        raise ApiError("this model has no chat template (tokenizer_config.json), so it "
                       "serves /v1/completions only")
    template = state.chat_template
    render = functools.partial(template.render, req.messages, req.tools,
                               enable_thinking=req.enable_thinking)
    if sum(len(m.get("content") or "") for m in req.messages) > TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(render)
    return render()


async def prompt_token_ids(state: ServerState, session: str, text: str,
                           request_id: str = "") -> list[int]:
    """Tokenize, reusing the session's previous token ids where the text extends it, and
    log a prefix break if the result extends none of the session's prompts."""
    ids = await spliced_token_ids(state, session, text)
    state.tracker.check(session, ids, request_id=request_id)
    return ids


async def _retention(state: ServerState, req: ChatRequest, text: str,
                     ids: list[int]) -> list[Retention]:
    """The request's cache_control marks in prompt tokens (orchestrator/shim/retention.py);
    a mark before the last message renders the conversation up to it once more."""
    if not req.retention_marks:
        return []
    template = state.chat_template
    assert template is not None  # render_prompt has refused a template-less model

    def upto(num_messages: int) -> str:
        return template.render(req.messages[:num_messages], req.tools,
                               add_generation_prompt=False, enable_thinking=req.enable_thinking)

    def compute() -> list[Retention]:
        return retention(req.retention_marks, len(req.messages), ids, text, upto,
                         state.tokenizer)

    if len(text) > TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(compute)
    return compute()


def thinking_budget(requested: int | None, server_cap: int) -> int | None:
    """The request's budget for its thinking span, under --max-thinking-tokens (0: none)."""
    if server_cap <= 0:
        return requested
    return server_cap if requested is None else min(requested, server_cap)


def output_budget(state: ServerState, num_prompt: int, requested: int | None) -> tuple[int, str]:
    """(max_tokens, the limit that set it: "request", "context" or "server").

    The request's max_tokens is clamped to the room the context leaves (Claude Code
    asks for 128000) and to --max-output-tokens. A prompt that leaves no room is
    refused with the message Claude Code recognises."""
    limit = state.max_model_len
    if num_prompt >= limit:
        raise ApiError(f"prompt is too long: {num_prompt} tokens > {limit - 1} maximum",
                       param="messages", code="context_length_exceeded")
    budget, by = limit - num_prompt, "context"
    if requested is not None and requested <= budget:
        budget, by = requested, "request"
    if 0 < state.options.max_output_tokens < budget:
        budget, by = state.options.max_output_tokens, "server"
    return budget, by


class ChatRun:
    """One chat request through the engine: a Generation, a reasoning splitter and a
    tool-call parser."""

    def __init__(self, state: ServerState, req: ChatRequest, prompt: ChatPrompt,
                 request_id: str, *, api: str,
                 hints: SchedulingHints = NO_HINTS) -> None:
        self.state = state
        self.req = req
        self.prompt = prompt
        max_tokens, self.limited_by = output_budget(state, len(prompt.token_ids),
                                                    req.max_tokens)
        # An answer held to a response format is that format, not calls: a reasoning
        # model thinks first and the grammar holds what follows its span (as in vLLM and
        # SGLang); without a span the grammar holds from the first token, and none of it
        # is reasoning (a template that opens <think> would make it all reasoning).
        formatted = prompt.grammar is not None and not prompt.forced
        # The engine follows the thinking span (counts it, caps it at the budget), except
        # after a forced call's opening: that answer is the call from its first token.
        thinking = None
        if state.think_tags is not None and not prompt.forced:
            budget = thinking_budget(req.thinking_budget, state.options.max_thinking_tokens)
            thinking = ThinkingSpan(*state.think_tags, inside=opens_in(prompt.text),
                                    budget=budget)
        grammar = prompt.grammar
        if formatted and thinking is not None:
            grammar = after_reasoning(grammar)
        self.splitter = make_splitter(
            "none" if formatted and thinking is None else state.options.reasoning_parser,
            prompt.text, strip_answer=formatted)
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            max_tokens=max_tokens,
            sampling=req.sampling,
            session_id=req.session,
            priority=hints.priority,
            timeout_s=hints.timeout_s,
            grammar=grammar,
            thinking=thinking,
            retention=prompt.retention,
            cache_salt=salted(state.tenants, hints.tenant, req.cache_salt),
        )
        self.gen = Generation(state.engine, state.tokenizer, request, req.delivery, api=api)
        if hints.tenant is not None:
            self.gen.log_fields["tenant"] = hints.tenant
        parse_calls = req.tools and req.tool_choice.mode != "none" and not formatted
        self.parser: ToolParser = make_tool_parser(
            state.options.tool_call_parser if parse_calls else "none", req.tools)
        # the model's answer continues the forced opening: the parser reads it first (and
        # holds it, as the start of a call)
        self.parser.feed(prompt.forced)
        if prompt.grammar is not None:
            by = "tool_choice" if prompt.forced else "response_format"
            self.gen.log_fields["guided_by"] = by
            state.metrics.guided_requests.labels(by=by).inc()
        self.num_tool_calls = 0
        self._recorded = False

    async def events(self) -> AsyncIterator[ChatEvent]:
        """Reasoning, answer text and tool calls, in the order the model wrote them."""
        async with contextlib.aclosing(self.gen.pieces()) as pieces:
            async for piece in pieces:
                for event in self._parse(self.splitter.feed(piece.text)):
                    yield self._count(event)
                    if self.num_tool_calls and not self.req.tool_choice.parallel:
                        if self.gen.finish_reason is None:  # one call only: it ends the answer
                            await self.gen.end_here()
                        self._record()
                        return
        for event in self._parse(self.splitter.finish()) + self.parser.finish():
            yield self._count(event)
        self._record()

    def _parse(self, parts: list[Reasoning | Answer]) -> list[ChatEvent]:
        """Reasoning goes out as it is; the answer goes through the tool-call parser."""
        events: list[ChatEvent] = []
        for part in parts:
            events += [part] if isinstance(part, Reasoning) else self.parser.feed(part.text)
        return events

    def _count(self, event: ChatEvent) -> ChatEvent:
        if isinstance(event, ToolCall):
            self.num_tool_calls += 1
        return event

    def _record(self) -> None:
        """Remember the turn for the session's next prompt (only a completed one: the
        client has all of its text)."""
        if self._recorded or self.gen.finish_reason not in ("stop", "length"):
            return
        self._recorded = True
        self.state.engine.turn_end(self.gen.request_id, tool_call=self.num_tool_calls > 0)
        self.state.tracker.record(
            self.req.session, self.prompt.token_ids, self.prompt.text, self.gen.token_ids,
            output_sent_whole=self.gen.stop_string is None and not self.gen.ended_early)

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        self.gen.log_fields["tool_calls"] = self.num_tool_calls
        self.gen.log_fields["max_tokens_set_by"] = self.limited_by
        self.gen.log_done(finish_reason=finish_reason, error=error)


def normalise(state: ServerState, req: ChatRequest) -> ChatRequest:
    """What the engine changes in a prompt so that sessions share their prefix, each
    change logged (prompt_normalised) and counted, and each behind a flag: Claude Code's
    billing header, different in every session, is left out of the prompt unless
    `--billing-header keep` (then it is rendered where the client sent it, first in the
    system prompt)."""
    if not req.billing_header:
        return req
    if state.options.billing_header == "keep":
        messages = list(req.messages)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0],
                           "content": f"{req.billing_header}\n{messages[0]['content']}"}
        else:  # the header was the whole system prompt: its own message, marks after it
            messages.insert(0, {"role": "system", "content": req.billing_header})
            req = replace(req, retention_marks=[
                replace(m, num_messages=m.num_messages + 1) for m in req.retention_marks])
        return replace(req, messages=messages)
    state.metrics.prompt_normalised.labels(what="billing_header").inc()
    log.info("prompt_normalised", session=req.session, dropped="billing_header",
             text=req.billing_header[:120])
    return req


def parse_chat(parse: Callable[[dict[str, Any], Any], ChatRequest]) -> Parse[ChatRequest]:
    """A chat API's `parse(body, headers)` as the pipeline's parse step: --max-messages
    and --max-tools are checked first, before any work is spent on the lists; then
    --on-image (placeholders.check_replaced)."""

    async def parse_body(state: ServerState, body: dict[str, Any], headers: Any) -> ChatRequest:
        check_counts(body, state)
        req = parse(body, headers)
        check_replaced(state, req.replaced, req.session)
        return normalise(state, req)

    return parse_body


async def render_chat(state: ServerState, req: ChatRequest,
                      hints: SchedulingHints = NO_HINTS) -> tuple[ChatRequest, ForcedCall, str]:
    """The conversation as the engine's prompt text, under the tenant's session (the tool
    call tool_choice requires, if any, opens the answer). The render endpoints
    (render.py) and `prepare_chat` share it, so a router's view of a prompt is the
    engine's."""
    req = replace(req, session=tenant_session(hints.tenant, req.session))
    forced = forced_call(state, req)
    return req, forced, await render_prompt(state, req) + forced.opening


async def spliced_token_ids(state: ServerState, session: str, text: str) -> list[int]:
    """The prompt's token ids: the session's previous ones where the text extends them."""
    base, rest = state.tracker.splice(session, text)
    return base + await tokenize(state.tokenizer, rest, add_special_tokens=False)


async def prepare_chat(state: ServerState, req: ChatRequest, request_id: str, *,
                       api: str, hints: SchedulingHints = NO_HINTS) -> ChatRun:
    """Render and tokenize the conversation for the engine."""
    req, forced, text = await render_chat(state, req, hints)
    ids = await prompt_token_ids(state, req.session, text, request_id)
    prompt = ChatPrompt(text, ids, forced.opening, forced.grammar or req.grammar,
                        await _retention(state, req, text, ids))
    return ChatRun(state, req, prompt, request_id, api=api, hints=hints)
