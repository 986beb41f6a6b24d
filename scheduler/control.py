"""The scheduler's control thread: its view of the engine, for `deepinfer-inspect`.

Answers are built on the control thread from the live scheduler, through copies
(`list(...)`, `dict(...)` are single atomic operations under the GIL), so they come
while the loop waits for a stuck rank. A value may be one step newer than another
in the same answer; `inspect check` compares only answers taken at one step.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

from scheduler.request import Sequence
from scheduler.scheduler import Scheduler
from scheduler.telemetry import Telemetry
from wire.client import UNCACHED_REASONS
from wire.control import (
    CacheRequest,
    CacheView,
    ControlError,
    QueuedRequest,
    RequestRecord,
    RunningSeq,
    SchedulerSnapshot,
    SeqRequest,
    SeqTable,
    SeqView,
    SessionCache,
    SnapshotRequest,
    StacksRequest,
    TierContents,
    TierRequest,
    TraceReply,
    TraceRequest,
)
from wire.control_server import ControlServer, stack_dump
from wire.digest import STATE_TIERS

# A snapshot holds overlap scheduling off this long: with a plan always in flight the
# scheduler is a step ahead of the ranks, and `deepinfer-inspect check` could never find
# an aligned round (scheduler/engine.py `EngineCore.step`).
OVERLAP_HOLD_S = 2.0
TOP_SESSIONS = 10


class SchedulerControl:
    def __init__(self, scheduler: Scheduler, telemetry: Telemetry, address: str,
                 log=None) -> None:
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.server = ControlServer(address, self.handle, log).start()

    def close(self) -> None:
        self.server.close()

    def handle(self, request: object) -> object:
        if isinstance(request, SnapshotRequest):
            return self.snapshot(request.detail)
        if isinstance(request, SeqRequest):
            return self.seq_view(request)
        if isinstance(request, TierRequest):
            return self.tier_contents(request)
        if isinstance(request, TraceRequest):
            return TraceReply(list(self.telemetry.trace)[-max(0, request.num_steps):])
        if isinstance(request, CacheRequest):
            return self.cache_view(request.num_requests)
        if isinstance(request, StacksRequest):
            return stack_dump("scheduler", -1, request.all_threads)
        return ControlError(f"the scheduler does not answer {type(request).__name__}")

    def tier_contents(self, request: TierRequest) -> TierContents:
        n = self.state_slots().get(request.tier, 0)
        return TierContents(request.tier, request.start, self.scheduler.digest.table_slice(
            request.tier, request.start, request.stop, n))

    def state_slots(self) -> dict[str, int]:
        """A hybrid model's state tables -> their slots, as the ranks hold them."""
        usage = self.scheduler.cache.state_usage()
        return {table: usage[tier]["capacity"] for table, tier in STATE_TIERS.items()
                if tier in usage}

    # --- the snapshot ---------------------------------------------------------------

    def snapshot(self, detail: bool = False) -> SchedulerSnapshot:
        sched, tel, cfg = self.scheduler, self.telemetry, self.scheduler.config
        now = time.monotonic()
        sched.overlap_hold_until = now + OVERLAP_HOLD_S
        # Read the step before the state it describes: if a plan lands in between, the
        # state is newer than `step`, which `check` sees as a moving engine and retries.
        step = sched.step - 1
        trace = list(tel.trace)
        running = list(sched.running)
        waiting = sched.waiting()
        if tel.last_error:
            state = "failed"
        else:
            state = "stepping" if tel.stepping else "idle"
        return SchedulerSnapshot(
            pid=os.getpid(), step=step, state=state,
            seconds_since_step=now - tel.t_step_end,
            seconds_in_step=now - tel.t_step_start if tel.stepping else 0.0,
            expected_digest=sched.digest.value, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_queued_requests=cfg.max_queued_requests,
            num_waiting=len(waiting), num_running=len(running),
            seqs=[SeqTable(sid, n, d) for sid, (n, d) in sorted(sched.digest.tables().items())],
            running=[_running(s, now) for s in running],
            waiting=self._waiting(waiting, len(running), trace, now),
            pending_closes=[s.seq_id for s in list(sched._to_close)],
            last_plan=trace[-1] if trace else None,
            usage=sched.cache.usage(),
            tier_digests=sched.digest.tier_digests() if detail else {},
            cache={k: int(v) for k, v in dict(vars(sched.cache.stats)).items()},
            last_error=tel.last_error,
            state_slots=self.state_slots(),
            state_entries=(sched.digest.state_entries()
                           if detail and sched.limits.is_hybrid else {}),
        )

    def _waiting(self, waiting: list[Sequence], num_running: int, trace: list,
                 now: float) -> list[QueuedRequest]:
        """Why the queue's head did not get in at the last step (everyone behind it waits
        for the same reason: admission stops at the first request that does not fit;
        `waiting` is in arrival order, the order of admission is scheduler/queue.py's)."""
        cfg = self.scheduler.config
        last = trace[-1] if trace else None
        wall_now = time.time()
        out = []
        for i, seq in enumerate(waiting):
            if last is None or wall_now - (now - seq.arrival) > last.time:
                reason = "arrived"  # not yet seen by a step
            elif num_running >= cfg.max_num_seqs:
                reason = "max_num_seqs"
            elif last.num_prefill_tokens + last.num_decode_tokens >= cfg.max_num_batched_tokens:
                reason = "token_budget"
            elif cfg.prefill_pack_tokens and last.num_prefill_tokens >= cfg.prefill_pack_tokens:
                reason = "prefill_pack"  # the step ran prompts enough: it starts next step
            else:
                reason = "no_blocks"
            out.append(QueuedRequest(seq.request_id, seq.seq_id, i, now - seq.arrival,
                                     len(seq.prompt), seq.num_preemptions, reason))
        return out

    # --- one sequence -------------------------------------------------------------------

    def _find(self, request: SeqRequest) -> Sequence | None:
        sched = self.scheduler
        if request.request_id:
            return dict(sched._by_request).get(request.request_id)
        for seq in list(sched.running) + list(sched._to_close) + sched.waiting():
            if seq.seq_id == request.seq_id:
                return seq
        return None

    def seq_view(self, request: SeqRequest) -> SeqView:
        seq = self._find(request)
        if seq is None:
            return SeqView("scheduler", -1, request.seq_id, found=False,
                           request_id=request.request_id)
        return SeqView(
            "scheduler", -1, seq.seq_id, found=seq.opened,
            block_ids=list(seq.block_ids)[:seq.num_sent_blocks] if seq.opened else [],
            num_tokens=seq.num_computed, request_id=seq.request_id, status=seq.status.value,
            num_prompt_tokens=len(seq.prompt), num_device_cached_tokens=seq.num_device_cached,
            num_host_cached_tokens=seq.num_host_cached)

    # --- the prefix cache ---------------------------------------------------------------

    def cache_view(self, num_requests: int) -> CacheView:
        records = list(self.telemetry.recent)
        last = records[-num_requests:] if num_requests > 0 else []
        sessions: dict[str, SessionCache] = defaultdict(lambda: SessionCache("", 0, 0, 0))
        for r in records:
            s = sessions[r.session or r.request_id]
            s.session = r.session or f"(request {r.request_id})"
            s.num_requests += 1
            s.num_prompt_tokens += r.num_prompt_tokens
            s.num_cached_tokens += (r.num_device_cached_tokens + r.num_host_cached_tokens
                                    + r.num_disk_cached_tokens)
        top = sorted(sessions.values(), key=lambda s: -s.num_cached_tokens)[:TOP_SESSIONS]
        cache = self.scheduler.cache
        return CacheView(
            num_requests=len(last),
            num_queried_tokens=sum(r.num_prompt_tokens for r in last),
            num_device_hit_tokens=sum(r.num_device_cached_tokens for r in last),
            num_host_hit_tokens=sum(r.num_host_cached_tokens for r in last),
            totals={k: int(v) for k, v in dict(vars(cache.stats)).items()},
            usage=cache.usage(), sessions=top,
            prefix_breaks=list(self.telemetry.prefix_breaks), recent=last[-10:],
            num_disk_hit_tokens=sum(r.num_disk_cached_tokens for r in last),
            disk=self._disk_counters(), state_usage=cache.state_usage(), **_miss_totals(last))

    def _disk_counters(self) -> dict[str, int]:
        disk = self.scheduler.cache.disk
        if not disk.num_slots:
            return {}
        return {"committed_writes": disk.num_committed_writes,
                "dropped_writes": disk.num_dropped_writes,
                "pending_writes": disk.num_pending, "evictions": disk.num_evictions,
                "bad_reads": disk.num_bad_reads,
                "found_after_restart": disk.num_found_at_start,
                "dropped_at_restart": self.scheduler.disk_torn_at_start}


def _miss_totals(records: list[RequestRecord]) -> dict[str, dict[str, int]]:
    """CacheView's uncached tokens by reason over `records`, and how many of them had
    each reason as their main one."""
    tokens = dict.fromkeys(UNCACHED_REASONS, 0)
    requests = dict.fromkeys(UNCACHED_REASONS, 0)
    for r in records:
        if r.uncached is None:
            continue
        for reason, n in r.uncached.by_reason().items():
            tokens[reason] += n
        if r.uncached.main_reason:
            requests[r.uncached.main_reason] += 1
    return {"uncached": tokens, "uncached_requests": requests}


def _running(seq: Sequence, now: float) -> RunningSeq:
    return RunningSeq(
        seq_id=seq.seq_id, request_id=seq.request_id, status=seq.status.value,
        num_prompt_tokens=len(seq.prompt), num_output_tokens=len(seq.output),
        num_computed_tokens=seq.num_computed, num_blocks=len(seq.block_ids),
        num_device_cached_tokens=seq.num_device_cached,
        num_host_cached_tokens=seq.num_host_cached, age_s=now - seq.arrival)
