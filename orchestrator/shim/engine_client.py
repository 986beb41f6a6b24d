"""The shim's asyncio client of the scheduler, over ZeroMQ.

One DEALER socket connects to the scheduler's ROUTER (`ipc://RUN_DIR/requests.sock`).
Every frame is one message encoded by `wire.codec` (msgpack, never pickle).

Message flow:

    shim  -> ClientHello(pid)              once, at start()
    shim  <- EngineInfo(...)               the answer; start() fails if it never comes
    shim  -> GenerateRequest(...)          one per request
    shim  <- RequestOutput(...)*           new tokens; the last has finished=True
    shim  -> AbortRequest(id, reason)      client gone ("abort") or stop string ("stop")
    shim  -> PrefixBreak(...)              a report for inspection (no answer)
    shim  -> TurnEnd(id, tool_call)        how an answer ended: its session's retention
    shim  <- Shutdown(reason)              the engine is going away: every request fails

One background task reads the socket and routes each RequestOutput to the queue of
its request, so any number of HTTP requests share the socket without locks.

The client outlives its scheduler. When the engine is lost (Shutdown, or the socket's
monitor sees the connection drop: a scheduler killed outright says no goodbye), every
live request fails with error_type "unavailable" (503 + retry-after), `connected` is
False, and ClientHello is sent again every HELLO_INTERVAL_S: the DEALER reconnects by
itself when a new scheduler binds the same address, and its EngineInfo makes the client
connected again (connection_watch.py). With a ResumePolicy (deepinfer-run --restart: the
launcher restarts the engine), a live request is not failed but waits for that new
scheduler and is continued there, its stream going on where it stopped (resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from orchestrator.shim.connection_watch import ConnectionWatch
from orchestrator.shim.resume import (
    NO_RESUME,
    EngineEpochs,
    Progress,
    ResumePolicy,
    log_resumed,
    with_seed,
)
from wire.client import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    StatsRequest,
    TurnEnd,
)
from wire.codec import ProtocolError, decode, encode
from wire.lifecycle import ClientHello, EngineInfo, Shutdown
from wire.security import secure_connect

if TYPE_CHECKING:
    from orchestrator.shim.metrics import Metrics, RequestTimer

log = structlog.get_logger()
ENDED_WIRE_IDS_KEPT = 1024  # resumed requests whose TurnEnd may still come


class EngineUnavailableError(RuntimeError):
    """The scheduler did not answer, or has shut down."""


class EngineClient:
    """Sends requests to the scheduler and streams their outputs back.

    Usage::

        client = EngineClient("ipc:///run/dir/requests.sock")
        info = await client.start()
        async for out in client.generate(request):
            ...
        await client.close()
    """

    def __init__(self, address: str, *, connect_timeout_s: float = 60.0,
                 resume: ResumePolicy = NO_RESUME) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.resume = resume
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._watch: ConnectionWatch | None = None  # connection events of _sock, re-hellos
        self._tasks: list[asyncio.Task[None]] = []  # the reader and the connection watcher
        self._first_info: asyncio.Future[EngineInfo] | None = None
        self._info: EngineInfo | None = None  # the latest scheduler's
        self._connected = False
        # wire id -> queue of its outputs; present while the engine runs the request
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        # request id -> the id the current engine knows it by (a continuation's is new:
        # resume.Progress.wire_id); present while the request is live here
        self._wire_ids: dict[str, str] = {}
        # ... and for a resumed request that ended, its last one: its TurnEnd, sent after
        # the end, must name the sequence the scheduler closed (a bounded memory)
        self._ended_wire_ids: OrderedDict[str, str] = OrderedDict()
        self._epochs = EngineEpochs()  # a continuation waits for a newer scheduler
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_reason: str | None = None  # why the engine was lost, last time
        self._stats: asyncio.Future[EngineStats] | None = None
        self._stats_lock = asyncio.Lock()
        self._metrics: Metrics | None = None
        self._timers: dict[str, RequestTimer] = {}  # request id -> its latency timer

    def attach_metrics(self, metrics: Metrics) -> None:
        """Observe every request's latencies into `metrics`, and forward the prefix
        breaks it counts to the scheduler (for `deepinfer-inspect cache`)."""
        self._metrics = metrics
        metrics.reporter = self._send_nowait

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Connect, say hello, and wait for the scheduler's EngineInfo.

        ZeroMQ queues the hello until the scheduler's socket exists, so the shim may
        start first; but if no answer comes within `connect_timeout_s` this raises
        EngineUnavailableError rather than leaving a shim that accepts requests no
        one will serve.
        """
        assert self._sock is None, "start() called twice"
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)  # close() must not hang on a dead scheduler
        self._watch = ConnectionWatch(self._sock, self._send_nowait, lambda: self._connected,
                                      self._lost)
        secure_connect(self._sock, self.address)  # CURVE over tcp://
        self._first_info = asyncio.get_running_loop().create_future()
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="engine-client-reader"),
            asyncio.create_task(self._watch.watch(), name="engine-client-monitor"),
        ]
        await self._sock.send(encode(ClientHello(pid=os.getpid())))
        try:
            info = await asyncio.wait_for(asyncio.shield(self._first_info),
                                          self.connect_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise EngineUnavailableError(
                f"the scheduler at {self.address} did not answer ClientHello within "
                f"{self.connect_timeout_s:g}s (is it running, and is this its run directory?)"
            ) from None
        log.info("engine_connected", address=self.address, model=info.model,
                 max_model_len=info.limits.max_model_len, vocab_size=info.limits.vocab_size)
        return info

    async def close(self) -> None:
        tasks = [*self._tasks, *(self._watch.tasks if self._watch else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self._sock is not None:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._connected = False
        self._epochs.stop("the engine client was closed")
        self._fail_all("the engine client was closed")

    def stop_resuming(self, reason: str) -> None:
        """No engine will come back (the shim is stopping: the launcher does so once its
        restarts are spent): the requests waiting for one end now, with the error their
        engine's loss gave them, and a later loss fails at once. Safe to call from a
        signal handler."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                self._loop.call_soon_threadsafe(self._epochs.stop, reason)

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "start() has not completed"
        return self._info

    @property
    def connected(self) -> bool:
        """True while a scheduler that answered ClientHello has not been lost since."""
        return self._connected

    # --- requests ---------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Send `request` and yield its outputs until the finished one.

        If the consumer stops early (closes the generator, or its task is cancelled
        because the HTTP client went away), the request is aborted at the scheduler
        so its sequence stops taking batch slots. If the engine dies under it and a
        ResumePolicy allows, the outputs pause and go on from a restarted engine
        (`_continue`); the consumer sees one stream.
        """
        if not self.connected:
            raise EngineUnavailableError(self._shutdown_reason or "not connected to the engine")
        rid = request.request_id
        assert rid not in self._wire_ids, f"duplicate request id {rid}"
        if self.resume.enabled:  # a continuation must draw what this send would have
            request = with_seed(request)
        progress = Progress(request, time.monotonic())
        # Register before sending: an output must never arrive for an unknown id.
        self._wire_ids[rid] = rid
        queue = self._streams[rid] = asyncio.Queue()
        timer = self._metrics.track(len(request.prompt_token_ids)) if self._metrics else None
        if timer is not None:
            self._timers[rid] = timer
        try:
            epoch = self._epochs.epoch
            await self._send(request)
            while True:
                out = await queue.get()
                if out.error_type == "unavailable" and self.resume.enabled:
                    continued = await self._continue(progress, out, epoch)
                    if continued is not None:
                        queue, epoch = continued
                        continue
                now = time.monotonic()
                out = progress.seen(out, now)
                if progress.attempt:
                    log_resumed(progress, out, now, self._metrics)
                if out.finished:
                    self._streams.pop(progress.wire_id, None)
                if timer is not None:
                    timer.output(out)
                yield out
                if out.finished:
                    return
        finally:
            if progress.wire_id != rid:
                self._ended_wire_ids[rid] = progress.wire_id
                while len(self._ended_wire_ids) > ENDED_WIRE_IDS_KEPT:
                    self._ended_wire_ids.popitem(last=False)
            self._wire_ids.pop(rid, None)
            if self._timers.pop(rid, None) is not None:
                timer.end("abort")  # a no-op when it ended with its last output or abort()
            # Still registered: the consumer left before the end (or the send failed).
            # Sent without awaiting: inside a cancelled task an await would raise again.
            if self._streams.pop(progress.wire_id, None) is not None:
                self._send_nowait(AbortRequest(request_id=progress.wire_id, reason="abort"))

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request. Its outputs are dropped from now on, and a generate()
        still iterating it will not send a second abort when it closes."""
        timer = self._timers.get(request_id)
        if timer is not None:
            timer.end(reason)
        wire_id = self._wire_ids.get(request_id, request_id)
        if self._streams.pop(wire_id, None) is not None:
            await self._send(AbortRequest(request_id=wire_id, reason=reason))

    def turn_end(self, request_id: str, tool_call: bool) -> None:
        """Tell the scheduler how an answer ended: whether its session's blocks stay
        retained (a tool call: the agent comes back) or not (scheduler `end_turn`). A
        resumed request is known there by its continuation's id."""
        wire_id = self._ended_wire_ids.pop(request_id, request_id)
        self._send_nowait(TurnEnd(request_id=wire_id, tool_call=tool_call))

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        """A snapshot of the engine's counters (one question in flight at a time)."""
        if not self.connected:  # asked now, it would be answered by the next scheduler
            raise EngineUnavailableError(self._shutdown_reason or "not connected to the engine")
        async with self._stats_lock:
            self._stats = asyncio.get_running_loop().create_future()
            await self._send(StatsRequest())
            try:
                return await asyncio.wait_for(self._stats, timeout_s)
            finally:
                self._stats = None

    @property
    def num_live_requests(self) -> int:
        return len(self._wire_ids)

    # --- continuing requests across a restart (resume.py) ---------------------------

    async def _continue(self, progress: Progress, failure: RequestOutput, epoch: int
                        ) -> tuple[asyncio.Queue[RequestOutput], int] | None:
        """The engine that ran `progress`'s request (the scheduler of `epoch`) died:
        wait for a newer one and send it the continuation. Returns the continuation's
        output queue and epoch, or None (the request then ends with `failure`)."""
        self._streams.pop(progress.wire_id, None)  # the dead engine's outputs are moot
        progress.lost(failure, time.monotonic())
        why_not = await self._epochs.wait_newer(progress, epoch, self.resume.timeout_s,
                                                lambda: self._connected)
        if why_not is not None:
            log.warning("request_not_resumed", request_id=progress.request.request_id,
                        reason=why_not, output_tokens=len(progress.output),
                        waited_s=round(time.monotonic() - progress.lost_at, 3),
                        error=failure.error)
            if self._metrics is not None:
                self._metrics.requests_not_resumed.labels(why_not).inc()
            return None
        previous = progress.wire_id
        continuation = progress.continuation(time.monotonic())
        self._wire_ids[progress.request.request_id] = continuation.request_id
        queue = self._streams[continuation.request_id] = asyncio.Queue()
        epoch = self._epochs.epoch
        # FIFO on the one socket: a send of the old id that the dead engine never read
        # reaches the new one first, and is stopped before the continuation comes
        await self._send(AbortRequest(previous, "abort"))
        await self._send(continuation)
        return queue, epoch

    # --- internals --------------------------------------------------------------

    async def _send(self, message: Any) -> None:
        if self._sock is None:
            raise EngineUnavailableError("the engine client is closed")
        await self._sock.send(encode(message))

    def _send_nowait(self, message: Any, flags: int = 0) -> None:
        if self._sock is None:
            return
        fut = self._sock.send(encode(message), flags)
        # Nobody awaits it: retrieve any exception so asyncio does not warn about it.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _read_loop(self) -> None:
        try:
            await self._read_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Without its reader the client can serve nothing, now or after a restart:
            # say so, fail what is live, and stay disconnected.
            log.exception("engine_reader_died")
            self._connected = False
            self._shutdown_reason = f"the engine connection failed: {exc!r}"
            self._fail_all(self._shutdown_reason)

    async def _read_forever(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            try:
                msg = decode(frame)
            except ProtocolError as exc:
                # A bad frame is a bug on the other side; losing it is better than
                # losing the shim (every other request would die with it).
                log.error("engine_bad_frame", error=str(exc))
                continue
            if isinstance(msg, RequestOutput):
                queue = self._streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
                # else: aborted or already finished here; the scheduler's late output is moot.
            elif isinstance(msg, EngineStats):
                if self._stats is not None and not self._stats.done():
                    self._stats.set_result(msg)
            elif isinstance(msg, EngineInfo):
                self._on_info(msg)
            elif isinstance(msg, Shutdown):
                self._lost(f"the engine shut down: {msg.reason or 'no reason given'}")
            else:
                log.error("engine_unexpected_message", type=type(msg).__name__)

    def _on_info(self, info: EngineInfo) -> None:
        """A scheduler answered ClientHello (repeated hellos get repeated answers)."""
        if self._connected:
            return
        reconnected = self._info is not None
        self._info = info
        self._connected = True
        self._epochs.answered()
        if self._first_info is not None and not self._first_info.done():
            self._first_info.set_result(info)
        if reconnected:
            log.info("engine_reconnected", address=self.address, model=info.model,
                     lost_because=self._shutdown_reason)
        self._shutdown_reason = None

    def _lost(self, reason: str) -> None:
        """The scheduler is gone: fail what is live, then call until a new one answers."""
        if self._connected or self._shutdown_reason is None:
            # the first word of a loss says most (a Shutdown names the failed rank; the
            # disconnect that follows it says nothing new)
            log.warning("engine_lost", reason=reason, live_requests=len(self._streams))
            self._shutdown_reason = reason
        self._connected = False
        self._fail_all(reason)
        if self._stats is not None and not self._stats.done():  # /metrics need not wait
            self._stats.set_exception(EngineUnavailableError(reason))
        assert self._watch is not None, "lost before start()"
        self._watch.call_until_answered()

    def _fail_all(self, reason: str) -> None:
        """End every live request with an "unavailable" error (503 + retry-after: the
        request was fine, the engine was not there), so no HTTP handler hangs."""
        for rid, queue in self._streams.items():
            queue.put_nowait(
                RequestOutput(
                    request_id=rid,
                    finished=True,
                    finish_reason="error",
                    error=reason,
                    error_type="unavailable",
                )
            )
        self._streams.clear()
