"""The one SSE streaming skeleton, which each API's response fills in with its events.

A stream opens with its first output, or after `ping_interval_s` without one: until then
nothing is sent, so an error (an overloaded engine, a prompt the scheduler refuses) is
still an HTTP error status (pipeline.sse_response). After it, an error is an event in
the API's shape. While a request waits for tokens (queue, long prefill, a tool call the
parser holds until it is whole) a keep-alive goes out each `ping_interval_s`, for
proxies and clients with read timeouts. However the stream ends, its source is closed
(which aborts the request if it still runs) and the request's one log line is written.

    opening (Anthropic message_start; OpenAI chat's role chunk; nothing for completions)
    chunks per output, a ping per quiet interval
    trailer (the OpenAI streams: the cache report as a comment, cache_report.py)
    closing (the finish reason, usage, the end marker)   or   error
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

from orchestrator.shim.errors import ApiError

T = TypeVar("T")


class SseStream(ABC, Generic[T]):
    """One request's stream in an API's shape: what `sse_stream` sends at each point."""

    # A keep-alive that opens the stream is sent after the opening too (Anthropic's
    # ping after message_start); False: the opening stands for it (OpenAI chat's role).
    ping_with_opening = True

    @abstractmethod
    def items(self) -> AsyncIterator[T]:
        """The request's outputs (pieces of text, or chat events)."""

    @abstractmethod
    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        """The request's one log line (only the first call logs)."""

    def opening(self) -> list[str]:
        return []

    @abstractmethod
    def ping(self) -> str: ...

    @abstractmethod
    def chunks(self, item: T) -> list[str]: ...

    @abstractmethod
    def error(self, err: ApiError) -> list[str]: ...

    def trailer(self) -> list[str]:
        """Sent before the closing events (never after an error)."""
        return []

    @abstractmethod
    def closing(self) -> list[str]: ...


async def sse_stream(stream: SseStream[T],
                     ping_interval_s: float) -> AsyncGenerator[str, None]:
    """`stream`'s events, in the order the module docstring gives. An ApiError before
    the opening propagates (the caller answers with its HTTP status)."""
    keepalive = with_keepalive(stream.items(), ping_interval_s)
    started = False
    try:
        async for item in keepalive:
            opened_now = not started
            if opened_now:
                started = True
                for chunk in stream.opening():
                    yield chunk
            if item is None:
                if not opened_now or stream.ping_with_opening:
                    yield stream.ping()
                continue
            for chunk in stream.chunks(item):
                yield chunk
    except ApiError as err:
        stream.log_done(finish_reason="error", error=err.message)
        if not started:
            raise
        for chunk in stream.error(err):
            yield chunk
        return
    finally:
        await keepalive.aclose()  # and the items with it
        stream.log_done()  # no-op unless the client left early (logged as an abort)
    if not started:  # no output and no keep-alive: the stream still opens
        for chunk in stream.opening():
            yield chunk
    for chunk in [*stream.trailer(), *stream.closing()]:
        yield chunk


async def with_keepalive(items: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """`items`, with a None between them whenever `interval_s` passes without one (the
    caller sends a keep-alive). The pending item is never cancelled by the timer.
    Closing this closes `items` too, after the item it may be waiting on is cancelled
    (in that order: `items` cannot close while it is running)."""
    it = aiter(items)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()
