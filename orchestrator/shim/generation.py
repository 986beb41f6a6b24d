"""Driving one request through the engine, whatever API it came from.

`Generation` sends a `GenerateRequest`, feeds the streamed tokens to a `Detokenizer`,
ends the request at the first stop string (aborting it at the scheduler with reason
"stop"), and keeps the counts every API reports: prompt tokens, tokens served from
each cache tier, output tokens, the finish reason. It writes the one log line per
request. The API modules only format what it yields.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from tokenizers import Tokenizer

from orchestrator.shim.detokenizer import Detokenizer, TextDelta
from orchestrator.shim.engine_client import EngineUnavailableError
from orchestrator.shim.errors import engine_error
from wire.client import GenerateRequest, UncachedTokens

log = structlog.get_logger()


@dataclass
class Delivery:
    """What the shim does with a request's output that the engine never sees, held beside
    the GenerateRequest the engine gets (the API modules build both)."""

    stop: list[str] = field(default_factory=list)  # stop strings: matched on the text, here
    stream: bool = False  # SSE events rather than one JSON body
    include_usage: bool = False  # OpenAI's stream_options.include_usage: a last usage chunk


@dataclass
class Piece:
    text: str  # new text, safe to send (stop strings and partial characters held back)
    token_ids: list[int]  # the engine's new tokens (may run past a stop string)


@dataclass
class EngineTiming:
    """Where an ended request's time went: the engine's queue and prefill, and the
    decode as the shim saw it (first token to the end)."""

    queue_s: float
    prefill_s: float
    decode_s: float


class Generation:
    """One request to the engine, from its GenerateRequest to text pieces and counts.

    `finish_reason` is "stop" (EOS, a stop token or a stop string; `stop_string` says
    which string), "length", "abort" or "error" once `pieces()` is done.
    """

    def __init__(
        self,
        engine: Any,  # EngineClient, or anything with its generate/abort
        tokenizer: Tokenizer,
        request: GenerateRequest,
        delivery: Delivery,
        *,
        api: str = "completions",
    ) -> None:
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self.delivery = delivery
        self.api = api
        self.detok = Detokenizer(
            tokenizer, stop=delivery.stop, prompt_token_ids=request.prompt_token_ids
        )
        self.token_ids: list[int] = []
        self.num_device_cached = 0
        self.num_host_cached = 0
        self.num_disk_cached = 0  # of the cached ones, read back from the disk tier
        self.num_reasoning_tokens = 0  # as the engine counts them (request.thinking)
        # why the rest of the prompt was computed; None until the engine admitted it (or
        # with prefix caching off)
        self.uncached: UncachedTokens | None = None
        self.timing: EngineTiming | None = None  # once it ended (cache_report.py)
        self._first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.ended_early = False  # end_here(): the client has not seen every token's text
        self.log_fields: dict[str, Any] = {}  # extra fields for the request_done line
        self._t0 = time.monotonic()
        self._logged = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_cached(self) -> int:
        return self.num_device_cached + self.num_host_cached + self.num_disk_cached

    @property
    def stop_string(self) -> str | None:
        return self.detok.matcher.matched

    def cache_creation_tokens(self, block_size: int) -> int:
        """Prompt tokens computed by this request and written to full (cacheable)
        blocks: the full blocks of the prompt minus those served from cache."""
        full = self.num_prompt_tokens // block_size * block_size if block_size > 0 else 0
        return max(0, full - self.num_cached)

    async def end_here(self) -> None:
        """End the answer at what the caller has read (the first tool call, when parallel
        calls are off): a stop, like a stop string's."""
        self.finish_reason, self.ended_early = "stop", True
        await self.engine.abort(self.request_id, "stop")

    async def pieces(self) -> AsyncIterator[Piece]:
        """A Piece per engine output; `finish_reason` is set before the last one.
        Raises ApiError if the engine reports an error."""
        outputs = self.engine.generate(self.request)
        try:
            async for out in outputs:
                # Cached counts may be on any output (the last may never come after a
                # stop-string abort; a preempted sequence may hit less the second time):
                # keep the largest seen.
                if (out.num_device_cached_tokens + out.num_host_cached_tokens
                        + out.num_disk_cached_tokens > self.num_cached):
                    self.num_device_cached = out.num_device_cached_tokens
                    self.num_host_cached = out.num_host_cached_tokens
                    self.num_disk_cached = out.num_disk_cached_tokens
                self.num_reasoning_tokens = max(self.num_reasoning_tokens,
                                                out.num_reasoning_tokens)
                if out.uncached is not None:  # the same on each output that has it
                    self.uncached = out.uncached
                if out.token_ids and self._first_token_at is None:
                    self._first_token_at = time.monotonic()
                if out.finished:
                    decode_s = (time.monotonic() - self._first_token_at
                                if self._first_token_at is not None else 0.0)
                    self.timing = EngineTiming(out.queue_s, out.prefill_s, decode_s)
                if out.finish_reason == "error":
                    raise engine_error(out.error_type, out.error)
                if not out.token_ids and not out.finished:
                    continue  # the cached counts of a long prefill, ahead of its tokens
                delta, kept = self._add(out.token_ids)
                self.token_ids += kept
                if delta.stopped:
                    self.finish_reason = "stop"
                    await self.engine.abort(self.request_id, "stop")
                    yield Piece(delta.text, kept)
                    return
                if out.finished:
                    tail = self.detok.finish()
                    self.finish_reason = "stop" if tail.stopped else (out.finish_reason or "stop")
                    yield Piece(delta.text + tail.text, out.token_ids)
                    return
                yield Piece(delta.text, out.token_ids)
        except EngineUnavailableError as exc:
            # the engine went away between the endpoint's check and the send: a 503 like
            # any request refused while the engine is gone, not a 500
            raise engine_error("unavailable", str(exc)) from None
        finally:
            await outputs.aclose()  # aborts the request if it is still running

    def _add(self, token_ids: list[int]) -> tuple[TextDelta, list[int]]:
        """Feed an output's tokens; returns the new text and the tokens it used. Several
        tokens come at once with speculative decoding: fed one by one, so a stop string
        ends the count at the token that completes it, as in a token-by-token stream."""
        if len(token_ids) <= 1:
            return self.detok.add(token_ids), token_ids
        text = []
        for n, token in enumerate(token_ids, 1):
            delta = self.detok.add([token])
            text.append(delta.text)
            if delta.stopped:
                return TextDelta("".join(text), True), token_ids[:n]
        return TextDelta("".join(text), False), token_ids

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        """One log line per request, whatever way it ended (only the first call logs)."""
        if self._logged:
            return
        self._logged = True
        log.info(
            "request_done",
            request_id=self.request_id,
            api=self.api,
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached,
            disk_cached_tokens=self.num_disk_cached,
            output_tokens=len(self.token_ids),
            reasoning_tokens=self.num_reasoning_tokens,
            finish_reason=finish_reason or self.finish_reason or "abort",
            stream=self.delivery.stream,
            duration_s=round(time.monotonic() - self._t0, 4),
            **self.log_fields,
            **({"error": error} if error else {}),
        )
