"""Every message that crosses a process boundary, as plain dataclasses.

One module so that the wire format can be read in one place. Messages are
encoded by the generic msgpack codec in `scheduler/codec.py`; nothing here is
ever pickled. Workers import this module and nothing else from the scheduler.

Vocabulary (see shared/DESIGN.md): a *sequence* owns a *block table* (device
block ids, `block_size` tokens each). A *step plan* carries, in the order the
ranks apply them: cache ops (swap_out, swap_in, close), block-table deltas
(new sequences, appended blocks), then the chunks of tokens to run forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.protocol.control import CONTROL_MESSAGE_TYPES
from scheduler.protocol.digest import StateDigest

SCHEMA_VERSION = 4  # 2: WorkerConnect carries pid and host_id; 3: guided decoding;
# 4: reasoning spans (GenerateRequest.thinking, RequestOutput.num_reasoning_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """The one frozen configuration built from the command line.

    Handed to every process as plain data (msgpack), so it holds only
    primitives. Derived values are properties.
    """

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    world_size: int = 1
    block_size: int = 16
    kv_cache_memory: int = 256 * 1024 * 1024  # bytes per rank for the device tier
    gpu_memory_utilization: float = 0.0  # CUDA only; > 0 sizes the device tier by profiling
    host_cache_memory: int = 0  # bytes per rank for the host tier; 0 disables it
    kv_write_policy: str = "write_back"  # host copy on device eviction, or "write_through"
    enable_prefix_caching: bool = True
    max_model_len: int = 0  # 0: take the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 256
    max_queued_tokens: int = 0  # prompt tokens waiting, all requests together; 0: no limit
    step_timeout_s: float = 300.0  # a rank that answers no step within this is hung
    full_cache_check_every: int = 0  # debug: the O(capacity) cache check every N steps
    attention_backend: str = "auto"  # auto | torch | flashinfer
    torch_threads: int = 0  # 0: cores / local ranks
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.kv_write_policy not in ("write_back", "write_through"):
            raise ValueError(f"unknown KV write policy {self.kv_write_policy!r}")
        if self.world_size < 1:
            raise ValueError("world_size must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_queued_requests < 1 or self.max_queued_tokens < 0:
            raise ValueError("max_queued_requests must be >= 1 and max_queued_tokens >= 0")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


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


# --- step plan: scheduler -> every rank -----------------------------------------


@dataclass
class NewSequence:
    """A sequence's block table, sent in full exactly once."""

    seq_id: int
    block_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class AppendBlocks:
    """Blocks appended to a live sequence's table (a delta, never the whole table)."""

    seq_id: int
    block_ids: list[int]


@dataclass
class ScheduledChunk:
    """Tokens of one sequence to run this step, at positions [start_pos, start_pos + len).

    Their KV is written into the sequence's blocks; attention sees every earlier
    position (the cached prefix included). `sample` asks rank 0 for a token at
    the chunk's last position.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool
    # guided decoding (scheduler/guided.py): the tokens the sample may take, bit i of
    # the little-endian 32-bit words for token i; None: any
    allowed: bytes | None = None


@dataclass
class StepPlan:
    step: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    close: list[int] = field(default_factory=list)  # seq ids whose block tables are dropped
    new_seqs: list[NewSequence] = field(default_factory=list)
    append: list[AppendBlocks] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # (device block, low 64 bits of its block hash): blocks registered in the prefix
    # index this step. Ranks mirror them (and carry them through swaps) only so the
    # state digest covers which hash lives in which block or host slot.
    register: list[tuple[int, int]] = field(default_factory=list)


# --- step result: every rank -> scheduler ---------------------------------------


@dataclass
class StepResult:
    step: int
    rank: int
    digest: int  # StateDigest.value after the step
    sampled: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, token); rank 0 only
    forward_s: float = 0.0
    error: str | None = None


# --- control --------------------------------------------------------------------


@dataclass
class WorkerConnect:
    """A rank's first message; the scheduler answers with the EngineConfig. `pid` and
    `host_id` (scheduler.rank_health.host_identity) let the scheduler tell a dead rank
    (on its own host) from a slow one."""

    rank: int
    world_size: int
    pid: int
    host_id: str


@dataclass
class WorkerReady:
    """A rank has loaded its shard and allocated its KV tiers (counts agreed across ranks)."""

    rank: int
    device: str
    num_device_blocks: int
    num_host_blocks: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    kv_bytes_per_block: int


# --- requests: shim <-> scheduler ---------------------------------------------


@dataclass
class ThinkingSpan:
    """Where a reasoning model's `<think>` span is in its output, by token ids, and how
    long it may grow (scheduler/thinking.py). `inside`: the prompt opened it already."""

    start_token_id: int
    end_token_id: int
    inside: bool = False
    budget: int | None = None  # reasoning tokens before the end tag is forced; None: no cap


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


@dataclass
class AbortRequest:
    request_id: str
    reason: str = "abort"  # "abort" (client gone) or "stop" (the shim matched a stop string)


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


@dataclass
class ClientHello:
    """The shim's first message; the scheduler answers with EngineInfo."""

    pid: int


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
    # queue_seconds, step_seconds, step_prefill_tokens, step_decode_tokens
    histograms: dict[str, HistogramData] = field(default_factory=dict)
    num_digest_mismatches: int = 0


@dataclass
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    world_size: int


@dataclass
class Shutdown:
    reason: str = ""


__all__ = ["StateDigest"]  # re-exported: ranks and the scheduler share one digest

MESSAGE_TYPES: tuple[type, ...] = (
    EngineConfig,
    SamplingParams,
    NewSequence,
    AppendBlocks,
    ScheduledChunk,
    StepPlan,
    StepResult,
    WorkerConnect,
    WorkerReady,
    GenerateRequest,
    AbortRequest,
    RequestOutput,
    ClientHello,
    EngineInfo,
    StatsRequest,
    HistogramData,
    EngineStats,
    Shutdown,
    *CONTROL_MESSAGE_TYPES,
)
