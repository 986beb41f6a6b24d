"""One request pipeline for every generating endpoint (/v1/messages,
/v1/chat/completions, /v1/completions, /v1/responses):

    admit (key, gate) -> read the body -> parse it in the endpoint's API
    -> scheduling headers -> the engine is there -> start (render, tokenize, a run)
    -> one JSON body, or an SSE stream (sse.py), with the cache report (cache_report.py)

and the plumbing that ties a response's life to the client's connection: a client that
leaves aborts its request, queued or streaming, and is logged as an abort.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from orchestrator.shim.admission import (
    SchedulingHints,
    admit,
    read_json_object,
    require_engine,
    scheduling_hints,
)
from orchestrator.shim.cache_report import cache_headers
from orchestrator.shim.errors import ApiError
from orchestrator.shim.generation import Delivery, Generation
from orchestrator.shim.sse import SseStream, sse_stream
from orchestrator.shim.state import ServerState, shim_state

T = TypeVar("T")
P = TypeVar("P")


class Reply(SseStream[Any]):
    """A started request, answered in its API's shape: one JSON body (`collect`) or,
    if its `delivery` says stream, the SSE events of SseStream."""

    delivery: Delivery

    @property
    @abstractmethod
    def generation(self) -> Generation:
        """The request's run through the engine (its counts, the cache's report)."""

    @abstractmethod
    async def collect(self) -> dict[str, Any]:
        """The non-streaming response."""


# parse(state, body, headers): the endpoint's API request, validated (ApiError if not)
Parse = Callable[[ServerState, dict[str, Any], Headers], Awaitable[P]]
# start(state, parsed, hints): the request made ready for the engine, as a Reply
Start = Callable[[ServerState, P, SchedulingHints], Awaitable[Reply]]


async def serve(request: Request, parse: Parse[P], start: Start[P]) -> Response:
    """The pipeline of the module docstring; `parse` and `start` are the API's."""
    state = shim_state(request)
    tenant = admit(request, state)
    body = await read_json_object(request, state)
    parsed = await parse(state, body, request.headers)
    hints = scheduling_hints(request, state, tenant)
    require_engine(state)  # again: it may have gone while the body was read
    reply = await start(state, parsed, hints)
    if not reply.delivery.stream:
        return await json_result(request, reply.collect(), reply.log_done,
                                 lambda: cache_headers(reply.generation, final=True))
    return await sse_response(request, sse_stream(reply, state.ping_interval_s),
                              reply.log_done,
                              lambda: cache_headers(reply.generation, final=False))


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


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
    headers: Callable[[], dict[str, str]] = dict,
) -> Response:
    """Answer with an SSE stream, but only once its first chunk is ready: an error
    before it (an overloaded engine, a prompt the scheduler refuses) still gets its
    HTTP status, which is impossible once the stream has started. `on_end` is the
    request's log_done; `headers` are asked for once the first chunk is ready."""
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
                                    headers={"cache-control": "no-cache", **headers()})


async def json_result(request: Request, work: Awaitable[dict[str, Any]],
                      on_end: Callable[..., None],
                      headers: Callable[[], dict[str, str]] = dict) -> Response:
    """The non-streaming answer: `work`'s JSON, aborted if the client leaves first;
    `headers` are asked for once it is done."""
    try:
        result = await unless_disconnected(request, work)
    except ClientGone:
        on_end(finish_reason="abort")
        return Response(status_code=499)
    except ApiError as err:
        on_end(finish_reason="error", error=err.message)
        raise
    on_end()
    return JSONResponse(result, headers=headers())
