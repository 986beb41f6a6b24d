"""What every endpoint of the shim shares: the engine it talks to, the tokenizer, the
limits and options, and the counters (one `ServerState`, on `app.state.shim`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from starlette.requests import Request
from tokenizers import Tokenizer

from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.metrics import Metrics
from orchestrator.shim.options import ShimOptions
from orchestrator.shim.prefix_tracker import PrefixTracker
from orchestrator.shim.reasoning import think_tag_ids
from orchestrator.shim.tenants import Tenants
from wire.client import EngineStats, GenerateRequest, RequestOutput
from wire.lifecycle import EngineInfo

log = structlog.get_logger()
# Prompts longer than this are tokenized (and rendered) in a thread so the event loop
# keeps streaming other requests.
TOKENIZE_IN_THREAD_CHARS = 20_000


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
    model_name: str  # the first served name: the one replies carry
    api_key: str | None = field(repr=False)  # never logged
    # --cache-salt-per-api-key: more keys, each salting its tenant's cache (tenants.py)
    tenants: Tenants | None = field(default=None, repr=False)
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
    # more names /v1/models lists after model_name (--served-model-name A B ...): a router
    # routes only the names a replica lists
    model_aliases: tuple[str, ...] = ()
    tracker: PrefixTracker = field(init=False)
    think_tags: tuple[int, int] | None = field(init=False)  # <think>, </think> token ids

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def __post_init__(self) -> None:
        self.tracker = PrefixTracker(self.tokenizer, on_break=self.metrics.count_prefix_break)
        self.think_tags = None
        if self.options.reasoning_parser != "none":
            self.think_tags = think_tag_ids(self.tokenizer)
            if self.think_tags is None:
                log.warning("thinking_spans_not_followed", reason="<think> or </think> is no "
                            "single, non-special token: reasoning is neither counted nor "
                            "capped by a budget")


def shim_state(request: Request) -> ServerState:
    return request.app.state.shim


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
