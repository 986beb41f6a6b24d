"""Messages of the control channel: `deepinfer-inspect` <-> each rank and the scheduler.

Every rank and the scheduler answer on their own socket (`control_address`) from a
control thread, so a rank stuck in a forward pass or a collective still answers.
One request, one reply; replies are plain data like every other message. A few
shim -> scheduler report (prefix breaks) rides the client socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.client import UncachedTokens

# --- requests: inspect CLI -> a control socket -------------------------------------


@dataclass
class SnapshotRequest:
    """`detail` adds each live table's digest and each tier's digest (O(state) to compute,
    so only `check` asks for them)."""

    detail: bool = False


@dataclass
class SeqRequest:
    """One sequence's view; the scheduler also resolves `request_id` to a seq id."""

    seq_id: int = -1
    request_id: str = ""


@dataclass
class TierRequest:
    """The block hashes held by `tier` ("device", "host" or "disk", or a hybrid model's
    state table: "state", "host_state" or "disk_state") at indices [start, stop)."""

    tier: str
    start: int
    stop: int


@dataclass
class TraceRequest:
    num_steps: int = 10


@dataclass
class CacheRequest:
    num_requests: int = 100  # hit ratios are over the last N finished requests


@dataclass
class StacksRequest:
    all_threads: bool = False


# --- replies ---------------------------------------------------------------------


@dataclass
class SeqTable:
    """A live sequence's block table, summarised: equal digests mean equal tables."""

    seq_id: int
    num_blocks: int
    table_digest: int = 0  # StateDigest entries of the table (0 unless asked for detail)


@dataclass
class RankSnapshot:
    rank: int
    pid: int
    device: str
    world_size: int
    step: int  # the last plan whose cache ops and table deltas this rank has applied
    state: str  # starting | idle | forward | failed
    seconds_since_step: float  # since the last step finished
    seconds_in_step: float  # in the current step (0 when idle)
    digest: int  # StateDigest.value after the last step
    seqs: list[SeqTable] = field(default_factory=list)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> used/cached/free
    tier_digests: dict[str, int] = field(default_factory=dict)  # which hash lives where
    last_error: str | None = None
    # > 0 while the main thread is blocked in a collective (waiting for its peers): a
    # stalled step's victims show it, the rank that stalls them does not
    seconds_in_collective: float = 0.0
    # a hybrid model's state tables (wire/digest.py STATE_TIERS) -> their slots (empty: none),
    # and (with detail) the slots of each that hold a snapshot
    state_slots: dict[str, int] = field(default_factory=dict)
    state_entries: dict[str, int] = field(default_factory=dict)


@dataclass
class RunningSeq:
    seq_id: int
    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_device_cached_tokens: int
    num_host_cached_tokens: int
    age_s: float


@dataclass
class QueuedRequest:
    request_id: str
    seq_id: int
    position: int
    age_s: float
    num_prompt_tokens: int
    num_preemptions: int
    # why it is waiting: no_blocks | token_budget | prefill_pack | max_num_seqs | arrived
    reason: str


@dataclass
class ChunkSummary:
    seq_id: int
    start_pos: int
    num_tokens: int
    sample: bool


@dataclass
class PlanSummary:
    """A step plan as the scheduler sent it, without token ids or block lists."""

    step: int
    time: float  # wall clock when sent
    duration_s: float  # until every rank answered (0 while in flight)
    close: list[int] = field(default_factory=list)
    new_seqs: list[int] = field(default_factory=list)
    num_append_blocks: int = 0
    num_new_blocks: int = 0
    num_swap_out: int = 0
    num_swap_in: int = 0
    num_register: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    chunks: list[ChunkSummary] = field(default_factory=list)


@dataclass
class SchedulerSnapshot:
    pid: int
    step: int  # the last plan sent to the ranks (-1: none yet)
    state: str  # idle | stepping | failed
    seconds_since_step: float
    seconds_in_step: float
    expected_digest: int  # what every rank must return for `step`
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queued_requests: int
    num_waiting: int
    num_running: int
    seqs: list[SeqTable] = field(default_factory=list)  # what the ranks must hold
    running: list[RunningSeq] = field(default_factory=list)
    waiting: list[QueuedRequest] = field(default_factory=list)
    pending_closes: list[int] = field(default_factory=list)
    last_plan: PlanSummary | None = None
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    tier_digests: dict[str, int] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)  # CacheStats counters
    last_error: str | None = None
    state_slots: dict[str, int] = field(default_factory=dict)  # as RankSnapshot's
    state_entries: dict[str, int] = field(default_factory=dict)


@dataclass
class SeqView:
    """One sequence as one process sees it; `found` is False when it holds no table."""

    role: str  # scheduler | rank
    rank: int  # -1 for the scheduler
    seq_id: int
    found: bool
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV is written (ranks: up to the last chunk run)
    request_id: str = ""
    status: str = ""
    num_prompt_tokens: int = 0
    num_device_cached_tokens: int = 0
    num_host_cached_tokens: int = 0


@dataclass
class TierContents:
    tier: str
    start: int
    hashes: list[int] = field(default_factory=list)  # 0: no hash registered there


@dataclass
class TraceReply:
    plans: list[PlanSummary] = field(default_factory=list)


@dataclass
class RequestRecord:
    """A finished request, as the scheduler logged it."""

    request_id: str
    session: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_device_cached_tokens: int
    num_host_cached_tokens: int
    queue_s: float
    ttft_s: float
    e2e_s: float
    num_disk_cached_tokens: int = 0
    uncached: UncachedTokens | None = None  # why the rest of its prompt was computed


@dataclass
class SessionCache:
    session: str
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class PrefixBreak:
    """Shim -> scheduler: a session's new prompt does not extend its previous one, so
    the cache can serve only the common part (`num_common_tokens`)."""

    session: str
    request_id: str = ""
    num_common_tokens: int = 0
    num_prompt_tokens: int = 0
    reason: str = ""
    time: float = 0.0


@dataclass
class CacheView:
    num_requests: int  # finished requests the ratios are over
    num_queried_tokens: int
    num_device_hit_tokens: int
    num_host_hit_tokens: int
    totals: dict[str, int] = field(default_factory=dict)  # CacheStats since start
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    sessions: list[SessionCache] = field(default_factory=list)  # top by cached tokens
    prefix_breaks: list[PrefixBreak] = field(default_factory=list)  # most recent last
    recent: list[RequestRecord] = field(default_factory=list)
    num_disk_hit_tokens: int = 0
    # the disk tier's own counters since start (empty when it is off): writes committed,
    # dropped and pending, evictions, bad reads, blocks found / dropped at start-up
    disk: dict[str, int] = field(default_factory=dict)
    # over the same requests: uncached prompt tokens by reason (wire/client.py
    # UNCACHED_REASONS), and how many requests had each as their main reason
    uncached: dict[str, int] = field(default_factory=dict)
    uncached_requests: dict[str, int] = field(default_factory=dict)
    # a hybrid model's state slots per tier (device, host, disk): used/cached/free/capacity
    state_usage: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class StackDump:
    role: str
    rank: int
    pid: int
    threads: dict[str, str] = field(default_factory=dict)  # thread name -> formatted stack


@dataclass
class ControlError:
    message: str


CONTROL_MESSAGE_TYPES: tuple[type, ...] = (
    SnapshotRequest, SeqRequest, TierRequest, TraceRequest, CacheRequest, StacksRequest,
    SeqTable, RankSnapshot, RunningSeq, QueuedRequest, ChunkSummary, PlanSummary,
    SchedulerSnapshot, SeqView, TierContents, TraceReply, RequestRecord, SessionCache,
    PrefixBreak, CacheView, StackDump, ControlError,
)
