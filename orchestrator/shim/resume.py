"""Continuing a request across an engine restart (`deepinfer-run --restart N`).

When the engine group dies (a rank, or the scheduler itself) and the launcher starts it
again, a request the shim was streaming is continued instead of failed. The engine client
(engine_client.py) keeps each live request's `Progress` -- the request, the tokens it
has handed on -- and once a restarted scheduler answers, sends it a continuation: the same
request under a new wire id, with `resumed_output` = the tokens handed on. The scheduler
recomputes prompt + output as a prefill (mostly cache hits where a host or disk tier kept
them), moves the grammar and the thinking span over the output, and samples the next
token at the position where the undisturbed run sampled it; max_tokens counts the resumed
output. A request that was still queued is continued the same way, with no output.

The client sees a pause, with SSE keep-alives meanwhile (sse.py), then the rest of the
stream, no token twice and none missing. The detokenizer, the stop strings, the tool-call
and reasoning parsers sit above the engine client: they read one stream and never learn
of the restart.

Determinism: greedy output is the undisturbed run's, token for token. The ranks key
sampling by (seed, position) (worker/sampler.py), and a request without a seed of its own
gets one derived from its id when it is first sent (`with_seed`), so the continuation
draws exactly what the undisturbed run would have drawn.

A request is not continued, and ends with the error the loss gave it (as without
--restart), when the engine is not back within `ResumePolicy.timeout_s`
(--resume-timeout), when the request's own deadline passes first, or when the shim learns
that no engine will come back (the launcher stops it once its restarts are spent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from wire.client import MIN_TEMPERATURE, GenerateRequest, RequestOutput

if TYPE_CHECKING:
    from orchestrator.shim.metrics import Metrics

log = structlog.get_logger()

DEFAULT_RESUME_TIMEOUT_S = 300.0  # deepinfer-run --resume-timeout
# What a continuation's wire id adds to the request's: `<id>.r<k>` for the k-th.
WIRE_ID_SUFFIX = ".r"


@dataclass(frozen=True)
class ResumePolicy:
    """How long a request in flight waits for a restarted engine; 0: it is never continued
    (no --restart: no engine comes back)."""

    timeout_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


NO_RESUME = ResumePolicy()


def request_seed(request_id: str) -> int:
    """A sampling seed from a request's id: the same at its first send and at a
    continuation (63 bits, as the ranks mix seeds)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def with_seed(request: GenerateRequest) -> GenerateRequest:
    """`request`, with a seed of its own if it samples without one (the engine would else
    seed it by the sequence number the dead scheduler gave it, which a continuation cannot
    know)."""
    sampling = request.sampling
    if sampling.seed is not None or sampling.temperature < MIN_TEMPERATURE:
        return request
    return replace(request, sampling=replace(sampling, seed=request_seed(request.request_id)))


class Progress:
    """One live request as the engine client has handed it on, and its continuations."""

    def __init__(self, request: GenerateRequest, now: float) -> None:
        self.request = request
        self.sent_at = now
        self.output: list[int] = []  # every token handed on, over all the engines
        self.attempt = 0  # continuations sent
        self.num_resumed = 0  # output tokens the latest continuation carried
        self.last_token_at: float | None = None
        self.failure: RequestOutput | None = None  # how the latest loss ended it
        # while paused: since when the client has seen nothing (its last token, or the
        # loss); until the first output of the continuation
        self.paused_at: float | None = None
        self.lost_at = 0.0  # when the latest loss was seen
        self.back_at = 0.0  # when the latest continuation was sent

    @property
    def wire_id(self) -> str:
        """The id the current engine knows it by. A continuation gets a new one: a
        request that the dead engine's socket still held may reach the new engine too,
        and must not be taken for it (it is aborted before the continuation is sent)."""
        rid = self.request.request_id
        return f"{rid}{WIRE_ID_SUFFIX}{self.attempt}" if self.attempt else rid

    def seen(self, out: RequestOutput, now: float) -> RequestOutput:
        """Record an output about to be handed on; returns it as the consumer gets it:
        under the request's own id, and for a continuation that resumed output, without
        the cached counts (the scheduler counts the resumed output in the hit: the first
        engine's counts of the prompt stand)."""
        if out.token_ids:
            self.output += out.token_ids
            self.last_token_at = now
        if not self.attempt:
            return out
        if not self.num_resumed:
            return replace(out, request_id=self.request.request_id)
        return replace(out, request_id=self.request.request_id, num_device_cached_tokens=0,
                       num_host_cached_tokens=0, num_disk_cached_tokens=0)

    def lost(self, failure: RequestOutput, now: float) -> None:
        """The engine died under it (`failure`: the error the loss gave it)."""
        self.failure = failure
        self.lost_at = now
        if self.paused_at is None:  # lost again before it streamed on: one pause
            self.paused_at = self.last_token_at or now

    def deadline_left(self, now: float) -> float | None:
        """Seconds to the request's own deadline (x-request-timeout); None: it has none."""
        timeout = self.request.timeout_s
        return None if timeout is None else timeout - (now - self.sent_at)

    def continuation(self, now: float) -> GenerateRequest:
        """The request to send the restarted engine: the output handed on so far is
        resumed, the deadline is what is left of it."""
        self.attempt += 1
        self.num_resumed = len(self.output)
        self.back_at = now
        return replace(self.request, request_id=self.wire_id, resumed_output=list(self.output),
                       timeout_s=self.deadline_left(now))

    def end_pause(self, out: RequestOutput, now: float) -> float | None:
        """The pause the client saw, once the continuation's first token (or its end)
        comes; None otherwise."""
        if self.paused_at is None or not (out.token_ids or out.finished):
            return None
        pause, self.paused_at = now - self.paused_at, None
        return pause


class EngineEpochs:
    """The schedulers that answered the client so far (the epoch: their count), for the
    requests waiting out a restart: a continuation waits for a scheduler newer than the
    one that ran it. Every change wakes the waiters (`_notify`)."""

    def __init__(self) -> None:
        self.epoch = 0
        self._changed = asyncio.Event()  # set (and replaced) when one answers, or on stop
        self.stopped: str | None = None  # why no engine will come back (`stop`)

    def answered(self) -> None:
        """A scheduler answered ClientHello: a newer epoch."""
        self.epoch += 1
        self._notify()

    def stop(self, reason: str) -> None:
        """No engine will come back: the waiting requests end now, later losses at once."""
        self.stopped = self.stopped or reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_newer(self, progress: Progress, epoch: int, timeout_s: float,
                         connected: Callable[[], bool]) -> str | None:
        """Wait until a scheduler newer than `epoch` answers: None once one has, else why
        the request is not continued ("stopping", "deadline", "timeout")."""
        give_up = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            left = progress.deadline_left(now)
            if self.stopped is not None:
                return "stopping"
            if left is not None and left <= 0:
                return "deadline"
            if connected() and self.epoch > epoch:
                return None
            if now >= give_up:
                return "timeout"
            wait = give_up - now if left is None else min(give_up - now, left)
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)


def log_resumed(progress: Progress, out: RequestOutput, now: float,
                metrics: Metrics | None) -> None:
    """A continued request's line, and its pause, once its stream goes on."""
    pause = progress.end_pause(out, now)
    if pause is None:
        return
    log.info("request_resumed", request_id=progress.request.request_id,
             attempt=progress.attempt, resumed_tokens=progress.num_resumed,
             pause_s=round(pause, 3),
             engine_wait_s=round(progress.back_at - progress.lost_at, 3),
             lost_because=progress.failure.error if progress.failure else None)
    if metrics is not None:
        metrics.requests_resumed.inc()
        metrics.resume_pause.observe(pause)
