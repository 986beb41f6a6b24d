"""What a request must pass before the shim spends work on it: the header size, the API
key, the gate (self-check, engine gone), the body's size and shape, the chat APIs' list
counts, and the scheduling headers. Refusals are `ApiError`s in the path's API shape."""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from orchestrator.shim.errors import ApiError, unavailable_error
from orchestrator.shim.json_body import parse_json_object
from orchestrator.shim.state import ServerState

PARSE_IN_THREAD_BYTES = 1 << 20  # a larger body is parsed in a thread
SELF_CHECK_HEADER = "x-deepinfer-self-check"
PRIORITY_HEADER = "x-deepinfer-priority"
TIMEOUT_HEADER = "x-request-timeout"


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


def check_auth(request: Request, state: ServerState) -> str | None:
    """`--api-key`, or any key of `--cache-salt-per-api-key`: required as `Authorization:
    Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients). Returns the
    key's tenant (None: the --api-key key, or no key required)."""
    if state.api_key is None and state.tenants is None:
        return None
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else request.headers.get(
        "x-api-key", ""
    )
    tenant = state.tenants.tenant_of(token) if state.tenants is not None else None
    if tenant is not None:
        return tenant
    if state.api_key is None or not hmac.compare_digest(token.encode(),
                                                        state.api_key.encode()):
        raise ApiError("invalid or missing API key", status=401,
                       type="authentication_error", code="invalid_api_key")
    return None


def check_counts(body: dict[str, Any], state: ServerState) -> None:
    """--max-messages and --max-tools for the chat APIs (--max-messages counts the
    Responses API's `input` items), checked before any work is spent on the lists (a body
    under the byte limit can still hold a million tiny items)."""
    for name, limit in (("messages", state.options.max_messages),
                        ("input", state.options.max_messages),
                        ("tools", state.options.max_tools)):
        items = body.get(name)
        if isinstance(items, list) and len(items) > limit:
            raise ApiError(f"{name}: {len(items)} given, this server accepts at most {limit}",
                           param=name)


def admit(request: Request, state: ServerState) -> str | None:
    """What every endpoint but /health and /metrics checks first: the API key, then
    whether the shim takes traffic now (not during the self-check but for its own
    requests; not while the engine is gone). Returns the key's tenant (check_auth).

    The self-check's own requests are authenticated by their secret header: a random
    token of this process, valid while the check runs, which the gate sends whether or
    not it has a key (with only --cache-salt-per-api-key it has none of its own)."""
    secret = state.self_check_secret
    passes_gate = bool(secret) and hmac.compare_digest(
        request.headers.get(SELF_CHECK_HEADER, "").encode(), secret.encode())
    tenant = None if passes_gate else check_auth(request, state)
    if state.unavailable is not None and not passes_gate:
        raise unavailable_error(
            f"the engine is not accepting requests yet: {state.unavailable}",
            state.retry_after_s)
    require_engine(state)
    return tenant


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
    tenant: str | None = None  # the API key's (--cache-salt-per-api-key): salts its cache


def scheduling_hints(request: Request, state: ServerState,
                     tenant: str | None = None) -> SchedulingHints:
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
    return SchedulingHints(priority or 0, timeout or (state.options.request_timeout_s or None),
                           tenant)


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
