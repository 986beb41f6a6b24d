"""A stand-in engine that answers each request with scripted outputs, so the shim's
parsers and streamers can be tested on exact token sequences (the real model has
random weights: it never writes a tool call on purpose).

    engine = ScriptedEngine(tokenizer)
    engine.script(text='<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    app = build_app(engine, tokenizer, model_name="m", chat_template=...)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from scheduler.thinking import ThinkingBudget
from wire.client import EngineStats, GenerateRequest, RequestOutput, UncachedTokens
from wire.lifecycle import EngineInfo, EngineLimits

EOS = 3  # <|im_end|> in the tiny model's tokenizer


@dataclass
class Script:
    token_ids: list[int]
    finish_reason: str = "stop"
    num_device_cached: int = 0
    num_host_cached: int = 0
    error_type: str | None = None  # an error output first (before any token) ...
    error_after: int | None = None  # ... or after this many tokens
    delay_s: float = 0.0  # before each output
    per_output: int = 1  # tokens per output (several: as speculative decoding sends them)
    uncached: UncachedTokens | None = None  # why the prompt missed: first and last output
    queue_s: float = 0.0  # the engine's timing, on the last output
    prefill_s: float = 0.0


@dataclass
class ScriptedEngine:
    tokenizer: Tokenizer
    max_model_len: int = 4096
    block_size: int = 16
    connected: bool = False
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    scripts: list[Script] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    turn_ends: list[tuple[str, bool]] = field(default_factory=list)  # (request id, tool call)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("tiny", self.block_size, 1, EngineLimits(
            vocab_size=self.tokenizer.get_vocab_size(), max_model_len=self.max_model_len,
            eos_token_ids=(EOS,), num_device_blocks=1024, num_host_blocks=0))

    async def start(self) -> EngineInfo:
        self.connected = True
        return self.info

    async def close(self) -> None:
        self.connected = False

    async def stats(self) -> EngineStats:
        raise RuntimeError("no stats here")

    def turn_end(self, request_id: str, tool_call: bool) -> None:
        self.turn_ends.append((request_id, tool_call))

    def script(self, text: str = "", *, eos: bool = True, **kwargs: object) -> Script:
        """Queue the answer to the next request: `text` one token per output."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids + ([EOS] if eos else [])
        s = Script(ids, **kwargs)  # type: ignore[arg-type]
        self.scripts.append(s)
        return s

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        s = self.scripts.pop(0) if self.scripts else Script([EOS])
        rid = request.request_id
        self.live.add(rid)
        common = dict(request_id=rid, num_prompt_tokens=len(request.prompt_token_ids),
                      num_device_cached_tokens=s.num_device_cached,
                      num_host_cached_tokens=s.num_host_cached)
        try:
            if s.error_type and s.error_after is None:
                yield RequestOutput(finished=True, finish_reason="error", error="scripted "
                                    f"{s.error_type}", error_type=s.error_type, **common)
                return
            ids = s.token_ids[: request.max_tokens]
            # reasoning counted as the scheduler counts it (its budget is not applied)
            span = request.thinking and ThinkingBudget(request.thinking, 1 << 16)
            for i in range(0, len(ids), s.per_output):
                group = ids[i:i + s.per_output]
                for t in group if span else ():
                    span.accept(t)
                    common["num_reasoning_tokens"] = span.num_tokens
                if s.delay_s:
                    await asyncio.sleep(s.delay_s)
                else:
                    await asyncio.sleep(0)
                if s.error_after is not None and i == s.error_after:
                    yield RequestOutput(finished=True, finish_reason="error", error="boom",
                                        error_type=s.error_type or "internal", **common)
                    return
                last = i + len(group) == len(ids)
                reason = None
                if last:
                    reason = s.finish_reason if len(ids) == len(s.token_ids) else "length"
                told = i == 0 or last  # as the scheduler sends it (Sequence.take_output)
                timing = dict(queue_s=s.queue_s, prefill_s=s.prefill_s) if last else {}
                yield RequestOutput(token_ids=group, finished=last, finish_reason=reason,
                                    uncached=s.uncached if told else None, **timing, **common)
            if not ids:
                yield RequestOutput(finished=True, finish_reason="length", **common)
        finally:
            self.live.discard(rid)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append((request_id, reason))
