"""Messages between the shim and the scheduler: requests, their outputs, and the engine's
counters for /metrics.

    shim -> scheduler   GenerateRequest, AbortRequest, TurnEnd, StatsRequest (and
                        PrefixBreak, wire/control.py)
    scheduler -> shim   RequestOutput (a stream per request), EngineStats

The shim tokenizes, so a request is token ids; sampling parameters ride with it to the
ranks (wire/step.py NewSequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature samples greedily (as in vLLM): logits / t overflows float32 to
# inf long before t reaches 0, softmax of inf is NaN, and the rank would fail the step.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    seed: int | None = None  # per-request seed; None: derived from the engine seed and seq id

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


@dataclass
class ThinkingSpan:
    """Where a reasoning model's `<think>` span is in its output, by token ids, and how
    long it may grow (scheduler/thinking.py). `inside`: the prompt opened it already."""

    start_token_id: int
    end_token_id: int
    inside: bool = False
    budget: int | None = None  # reasoning tokens before the end tag is forced; None: no cap


@dataclass
class Retention:
    """Keep the full blocks of the prompt's first ``num_tokens`` tokens cached ``ttl_s``
    after their last use, before any unmarked block (Anthropic's `cache_control`)."""

    num_tokens: int
    ttl_s: float


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cache_salt: str | None = None
    session_id: str | None = None  # lets the scheduler reuse the session's block hashes
    priority: int = 0  # admission order: lower first (scheduler/queue.py)
    timeout_s: float | None = None  # deadline from arrival; past it: error "timeout"
    grammar: str | None = None  # llguidance grammar the output follows (scheduler/guided.py)
    thinking: ThinkingSpan | None = None  # counted, and capped if it has a budget
    retention: list[Retention] = field(default_factory=list)  # cache/retention.py
    # A continuation after an engine restart (orchestrator/shim/resume.py): the output the
    # client was sent before the engine died. The sequence resumes after it, recomputing it
    # as a preempted sequence's; its grammar and thinking span are moved over it first, and
    # max_tokens still counts it. None: a new request.
    resumed_output: list[int] | None = None


@dataclass
class TurnEnd:
    """Shim -> scheduler: how an agent's answer ended. One that ends in a tool call keeps
    its session's blocks retained (the agent comes back with the result within seconds);
    one that does not lets them go to the plain LRU (a finished sub-agent, a turn that
    waits for its user): scheduler `Scheduler.end_turn`."""

    request_id: str
    tool_call: bool


@dataclass
class AbortRequest:
    request_id: str
    reason: str = "abort"  # "abort" (client gone) or "stop" (the shim matched a stop string)


# Why a prompt token was computed rather than served from cache (cache/miss_reasons.py),
# in the order that breaks a tie for a request's main reason: the one an operator can act on
# first. block_remainder: the last partial block and the last token, never served.
UNCACHED_REASONS = ("evicted", "diverged", "compaction", "salt", "no_room", "no_state", "new",
                    "block_remainder")


@dataclass
class UncachedTokens:
    """A request's prompt tokens the cache did not serve, split by reason (they sum to the
    prompt tokens minus the cached ones), as found at its first admission."""

    evicted: int = 0  # cached once, then dropped by every tier that held it
    diverged: int = 0  # the session's previous prompt had other tokens here (an edit)
    compaction: int = 0  # a much shorter prompt after the session's long one (a summary)
    salt: int = 0  # the session's previous request has these tokens under another salt
    no_room: int = 0  # on disk, but no host slot was free to read them into
    # a hybrid model: cached KV past the last block whose linear-attention state was
    # snapshotted (cache/state_pool.py): the state is needed to go on from there
    no_state: int = 0
    new: int = 0  # never cached, as far as the cache's memory of drops tells
    block_remainder: int = 0  # the last partial block and the last token
    # the first evicted block: the tier that dropped it last, how long before the
    # admission, and what took its place (cache/eviction_memory.py CAUSES)
    evicted_tier: str = ""
    evicted_age_s: float = 0.0
    evicted_by: str = ""
    diverged_at: int = -1  # diverged, compaction: the first token unlike the previous prompt

    @property
    def num_tokens(self) -> int:
        return sum(self.by_reason().values())

    def by_reason(self) -> dict[str, int]:
        return {reason: getattr(self, reason) for reason in UNCACHED_REASONS}

    @property
    def main_reason(self) -> str:
        """The reason with the most tokens ("" when every token was cached)."""
        counts = self.by_reason()
        best = max(UNCACHED_REASONS, key=lambda r: counts[r])  # the first of equals
        return best if counts[best] else ""


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; the last one has finished=True."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_device_cached_tokens: int = 0  # prompt tokens served from the device tier
    num_host_cached_tokens: int = 0  # prompt tokens served from the host tier
    error: str | None = None
    # invalid_request | overloaded | timeout | unavailable | internal
    error_type: str | None = None
    num_reasoning_tokens: int = 0  # output tokens inside the thinking span so far
    num_disk_cached_tokens: int = 0  # prompt tokens served from the disk tier
    # why the rest of the prompt was computed: on the request's first output after its
    # admission, and on its last (None on the others, and when prefix caching is off)
    uncached: UncachedTokens | None = None
    # where its time went in the engine, on its last output: waiting in the queue (arrival
    # to its first admission), then its prefill (to its first token, swap-ins included)
    queue_s: float = 0.0
    prefill_s: float = 0.0


@dataclass
class StatsRequest:
    """The shim asks for a snapshot of the engine's counters (for /metrics)."""

    nonce: int = 0


@dataclass
class HistogramData:
    """A histogram kept by the scheduler: counts per bucket (upper bounds `bounds`, the
    last bucket is +Inf, so len(counts) == len(bounds) + 1), not cumulative."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0


@dataclass
class EngineStats:
    """Counters are totals since start; gauges are the current values."""

    step: int
    num_waiting: int
    num_running: int
    num_prefill_tokens: int
    num_decode_tokens: int
    step_seconds: float
    kv_bytes_per_block: int
    cache: dict[str, int]  # cache.stats.CacheStats counters
    usage: dict[str, dict[str, int]]  # tier -> capacity/used/cached/free, in blocks
    # queue_seconds, step_seconds, step_prefill_tokens, step_decode_tokens; with speculative
    # decoding spec_accepted_drafts (per drafted decode, how many drafts the model kept)
    histograms: dict[str, HistogramData] = field(default_factory=dict)
    num_digest_mismatches: int = 0
    num_spec_draft_tokens: int = 0  # draft tokens proposed (speculative decoding)
    num_spec_accepted_tokens: int = 0  # of them, kept by the model
    # the disk tier (empty when off): num_read_blocks, num_committed_writes,
    # num_dropped_writes, num_pending_writes, queue_depth, found_at_start, torn_at_start
    disk: dict[str, int] = field(default_factory=dict)
    # a hybrid model's state slots, tier -> capacity/used/cached/free (empty: not hybrid)
    state_usage: dict[str, dict[str, int]] = field(default_factory=dict)
