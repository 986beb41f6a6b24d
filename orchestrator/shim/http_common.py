"""What every HTTP endpoint of the shim shares: its state, auth, body reading, and
the plumbing that ties a response's life to the client's connection."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from tokenizers import Tokenizer

from orchestrator.config import ShimOptions
from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.errors import ApiError, unavailable_error
from orchestrator.shim.json_body import parse_json_object
from orchestrator.shim.metrics import Metrics
from orchestrator.shim.prefix_tracker import PrefixTracker
from orchestrator.shim.reasoning import think_tag_ids
from wire.client import EngineStats, GenerateRequest, RequestOutput
from wire.lifecycle import EngineInfo

T = TypeVar("T")
log = structlog.get_logger()
# Prompts longer than this are tokenized (and rendered) in a thread so the event loop
# keeps streaming other requests.
TOKENIZE_IN_THREAD_CHARS = 20_000
PARSE_IN_THREAD_BYTES = 1 << 20
SELF_CHECK_HEADER = "x-deepinfer-self-check"
PRIORITY_HEADER = "x-deepinfer-priority"
TIMEOUT_HEADER = "x-request-timeout"


class Engine(Protocol):
    """What the app needs of `EngineClient` (tests pass a stand-in)."""

    @property
    def connected(self) -> bool: ...
    @property
    def info(self) -> EngineInfo: ...
    async def start(self) -> EngineInfo: ...
    async def close(self) -> None: ...
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...
    async def stats(self) -> EngineStats: ...
    async def abort(self, request_id: str, reason: str = "abort") -> None: ...


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = field(repr=False)  # never logged
    metrics: Metrics = field(default_factory=Metrics)
    max_model_len: int = 0  # the limit requests are checked against; set at start-up
    vocab_size: int = 0
    block_size: int = 16
    created: int = 0
    chat_template: ChatTemplate | None = None
    options: ShimOptions = field(default_factory=ShimOptions)  # limits, parsers, caps
    ping_interval_s: float = 5.0  # SSE keep-alive while a request waits for tokens
    # While set, every endpoint but /health and /metrics answers 503 + retry-after with
    # this reason (the start-up self-check is running; the engine is restarting).
    unavailable: str | None = None
    retry_after_s: int = 5
    self_check_secret: str | None = None  # the self-check's own requests pass the gate
    tracker: PrefixTracker = field(init=False)
    think_tags: tuple[int, int] | None = field(init=False)  # <think>, </think> token ids

    def __post_init__(self) -> None:
        self.tracker = PrefixTracker(self.tokenizer, on_break=self.metrics.count_prefix_break)
        self.think_tags = None
        if self.options.reasoning_parser != "none":
            self.think_tags = think_tag_ids(self.tokenizer)
            if self.think_tags is None:
                log.warning("thinking_spans_not_followed", reason="<think> or </think> is no "
                            "single, non-special token: reasoning is neither counted nor "
                            "capped by a budget")


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


def shim_state(request: Request) -> ServerState:
    return request.app.state.shim


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(err: ApiError, *, anthropic: bool = False) -> JSONResponse:
    if anthropic:
        return JSONResponse(err.anthropic_body(), status_code=err.anthropic_status,
                            headers=err.headers)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class HeaderLimit:
    """ASGI wrapper: requests whose headers add up to more than `limit` bytes get a 431.

    uvicorn's h11 limit (h11_max_incomplete_event_size) only applies to a head still
    incomplete after a read, so a head that arrives whole in one read passes it; this
    check is exact, and answers in the shape of the API the path belongs to."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.limit:
                err = ApiError(f"the request headers ({size} bytes) are larger than "
                               f"{self.limit} bytes", status=431)
                response = error_response(err, anthropic=is_anthropic_path(scope["path"]))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_auth(request: Request, state: ServerState) -> None:
    """`--api-key`: required as `Authorization: Bearer KEY` (OpenAI clients) or
    `x-api-key: KEY` (Anthropic clients)."""
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else request.headers.get(
        "x-api-key", ""
    )
    if not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise ApiError("invalid or missing API key", status=401,
                       type="authentication_error", code="invalid_api_key")


def check_counts(body: dict[str, Any], state: ServerState) -> None:
    """--max-messages and --max-tools for the chat APIs, checked before any work is
    spent on the lists (a body under the byte limit can still hold a million tiny items)."""
    for name, limit in (("messages", state.options.max_messages),
                        ("tools", state.options.max_tools)):
        items = body.get(name)
        if isinstance(items, list) and len(items) > limit:
            raise ApiError(f"{name}: {len(items)} given, this server accepts at most {limit}",
                           param=name)


def admit(request: Request, state: ServerState) -> None:
    """What every endpoint but /health and /metrics checks first: the API key, then
    whether the shim takes traffic now (not during the self-check but for its own
    requests; not while the engine is gone)."""
    check_auth(request, state)
    secret = state.self_check_secret
    passes_gate = bool(secret) and hmac.compare_digest(
        request.headers.get(SELF_CHECK_HEADER, "").encode(), secret.encode())
    if state.unavailable is not None and not passes_gate:
        raise unavailable_error(
            f"the engine is not accepting requests yet: {state.unavailable}",
            state.retry_after_s)
    require_engine(state)


def require_engine(state: ServerState) -> None:
    """503 + retry-after while the shim has no engine: it failed, or is restarting (the
    client reconnects by itself when the new one is up)."""
    if not state.engine.connected:
        raise unavailable_error("the engine is not available (restarting?)",
                                state.retry_after_s)


@dataclass(frozen=True)
class SchedulingHints:
    """How the scheduler should treat a request, from its headers (either API)."""

    priority: int = 0  # x-deepinfer-priority: admission order, lower first
    timeout_s: float | None = None  # x-request-timeout, else the server's default


def scheduling_hints(request: Request, state: ServerState) -> SchedulingHints:
    def number(name: str, kind: type) -> Any:
        raw = request.headers.get(name)
        if raw is None:
            return None
        try:
            value = kind(raw)
        except ValueError:
            raise ApiError(f"header {name}: not a valid {kind.__name__}: {raw[:40]!r}") from None
        return value

    priority = number(PRIORITY_HEADER, int)
    timeout = number(TIMEOUT_HEADER, float)
    if priority is not None and not -(2**31) <= priority < 2**31:
        raise ApiError(f"header {PRIORITY_HEADER}: out of range")
    if timeout is not None and not 0 < timeout < 1e9:  # NaN fails too
        raise ApiError(f"header {TIMEOUT_HEADER}: must be a number of seconds > 0")
    return SchedulingHints(priority or 0, timeout or (state.options.request_timeout_s or None))


async def read_json_object(request: Request, state: ServerState) -> dict[str, Any]:
    """The body as a JSON object; 413 past `max_request_bytes`, 400 if not one (see
    json_body)."""
    limit = state.options.max_request_bytes
    too_large = ApiError(f"the request body is larger than {limit} bytes", status=413,
                         type="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if size > PARSE_IN_THREAD_BYTES:  # the event loop keeps streaming other requests
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


async def tokenize(tokenizer: Tokenizer, text: str, *,
                   add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (chat prompts: add_special_tokens=False, the template
    already wrote them)."""
    if len(text) > TOKENIZE_IN_THREAD_CHARS:
        enc = await asyncio.to_thread(tokenizer.encode, text,
                                      add_special_tokens=add_special_tokens)
    else:
        enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return enc.ids


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its request) if the client leaves first.

    Starlette only watches for disconnects while a streaming body is being sent; a
    request queued for minutes before its first token must be abortable too.
    """

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its abort go out
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def prepend(first: str, rest: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()  # closed from outside, this generator must close `rest` too


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the stream ends.

    Depending on the ASGI version, a client disconnect either cancels the stream or
    makes `send` raise; in the second case the body generator would be left suspended
    until garbage collection, and the engine would keep generating for nobody.
    """

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        except OSError:
            pass  # ASGI >= 2.4: the client left; an expected end, not a server error
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def sse_response(
    request: Request,
    chunks: AsyncGenerator[str, None],
    on_end: Callable[..., None],
) -> Response:
    """Answer with an SSE stream, but only once its first chunk is ready: an error
    before it (an overloaded engine, a prompt the scheduler refuses) still gets its
    HTTP status, which is impossible once the stream has started. `on_end` is the
    request's log_done."""
    try:
        first = await unless_disconnected(request, chunks.__anext__())
    except ClientGone:
        await chunks.aclose()
        on_end(finish_reason="abort")
        return Response(status_code=499)
    except ApiError as err:
        await chunks.aclose()
        on_end(finish_reason="error", error=err.message)
        raise
    return ClosingStreamingResponse(prepend(first, chunks), media_type="text/event-stream",
                                    headers={"cache-control": "no-cache"})


async def json_result(request: Request, work: Awaitable[dict[str, Any]],
                      on_end: Callable[..., None]) -> Response:
    """The non-streaming answer: `work`'s JSON, aborted if the client leaves first."""
    try:
        result = await unless_disconnected(request, work)
    except ClientGone:
        on_end(finish_reason="abort")
        return Response(status_code=499)
    except ApiError as err:
        on_end(finish_reason="error", error=err.message)
        raise
    on_end()
    return JSONResponse(result)
