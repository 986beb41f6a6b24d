"""What the scheduler records about its own work, for metrics, logs and inspection.

- every step, from the record the engine makes of it (`StepRecord`): its plan,
  summarised, in a ring (`deepinfer-inspect trace`), and whether a step is in flight;
- histograms of queue wait, step time and tokens per step (`/metrics`);
- every request from arrival to its end, logged once at its end with its token
  counts, cached tokens per tier, why the rest was computed (uncached tokens by reason,
  cache/miss_reasons.py) and latencies, and kept in a ring for `inspect cache`;
- the prefix breaks the shim reports.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

import structlog

from scheduler.executor import ExchangeTiming
from scheduler.request import Sequence
from wire.client import HistogramData, RequestOutput, UncachedTokens
from wire.control import ChunkSummary, PlanSummary, PrefixBreak, RequestRecord
from wire.step import RankTiming, StepPlan

TRACE_STEPS = 256
RECENT_REQUESTS = 1000
RECENT_BREAKS = 64


class Histogram:
    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def data(self) -> HistogramData:
        return HistogramData(list(self.bounds), list(self.counts), self.sum)


SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]
TOKENS = [0, 1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 65536]


@dataclass
class StepRecord:
    """One engine step (scheduler/engine.py), for telemetry, /metrics and the benchmarks.
    Seconds per part: `execute_s` is the executor call (IPC + forward + wait), of which
    `forward_s` is rank 0's own forward pass; `step_s` is the whole step, the record and
    telemetry included. The finer parts below are for the engine-overhead breakdown
    (StepTotals.breakdown)."""

    summary: PlanSummary  # the plan in brief, with its prefill and decode token counts
    outputs: list[RequestOutput] = field(default_factory=list)
    schedule_s: float = 0.0
    execute_s: float = 0.0
    forward_s: float = 0.0
    update_s: float = 0.0
    step_s: float = 0.0
    digest_s: float = 0.0  # of schedule_s: predicting the ranks' digest
    check_s: float = 0.0  # of update_s: the digests compared, the cache accounting checked
    cpu_s: float = 0.0  # the scheduler thread's CPU time in the step (time.thread_time)
    exchange: ExchangeTiming | None = None  # the executor's side (ZmqExecutor only)
    ranks: list[RankTiming] = field(default_factory=list)  # each rank's side, in rank order


@dataclass
class _Tracked:
    seq: Sequence
    admitted: float | None = None


class Telemetry:
    def __init__(self, log=None) -> None:
        self.log = log or structlog.get_logger()
        self.trace: deque[PlanSummary] = deque(maxlen=TRACE_STEPS)
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self.prefix_breaks: deque[PrefixBreak] = deque(maxlen=RECENT_BREAKS)
        self.hist = {"queue_seconds": Histogram(SECONDS), "step_seconds": Histogram(SECONDS),
                     "step_prefill_tokens": Histogram(TOKENS),
                     "step_decode_tokens": Histogram(TOKENS)}
        self.stepping = False
        self.t_step_start = 0.0
        self.t_step_end = time.monotonic()
        self.last_error: str | None = None
        self.num_digest_mismatches = 0
        self._by_request: dict[str, _Tracked] = {}
        self._by_seq: dict[int, _Tracked] = {}

    def histograms(self) -> dict[str, HistogramData]:
        return {name: h.data() for name, h in self.hist.items()}

    # --- steps (from the engine) -----------------------------------------------------

    def step_started(self, record: StepRecord) -> None:
        """The plan is made and about to run on the ranks."""
        summary = record.summary
        structlog.contextvars.bind_contextvars(step=summary.step)
        now = time.monotonic()
        for seq_id in summary.new_seqs:
            tracked = self._by_seq.get(seq_id)
            if tracked is not None and tracked.admitted is None:  # not a re-admission
                tracked.admitted = now
                self.hist["queue_seconds"].observe(now - tracked.seq.arrival)
        self.trace.append(summary)
        self.t_step_start, self.stepping = now, True

    def step_done(self, record: StepRecord) -> None:
        """The ranks ran the plan and its results are applied."""
        summary = record.summary
        summary.duration_s = record.execute_s
        self.hist["step_seconds"].observe(summary.duration_s)
        self.hist["step_prefill_tokens"].observe(summary.num_prefill_tokens)
        self.hist["step_decode_tokens"].observe(summary.num_decode_tokens)
        self.t_step_end, self.stepping = time.monotonic(), False

    def failed(self, error: str, digest_mismatch: bool = False) -> None:
        self.last_error = error
        self.num_digest_mismatches += digest_mismatch

    # --- requests (from the server loop) ------------------------------------------------

    def request_added(self, seq: Sequence) -> None:
        tracked = _Tracked(seq)
        self._by_request[seq.request_id] = tracked
        self._by_seq[seq.seq_id] = tracked

    def request_done(self, out: RequestOutput) -> None:
        """Log a request once, at its end (the output with finished=True)."""
        tracked = self._by_request.pop(out.request_id, None)
        if tracked is None:  # rejected at arrival: logged there
            return
        seq = tracked.seq
        self._by_seq.pop(seq.seq_id, None)
        now = time.monotonic()
        first = seq.first_token_time
        num_out = len(seq.output)
        record = RequestRecord(
            request_id=seq.request_id, session=seq.session_id or "",
            finish_reason=out.finish_reason or "", num_prompt_tokens=len(seq.prompt),
            num_output_tokens=num_out, num_device_cached_tokens=seq.num_device_cached,
            num_host_cached_tokens=seq.num_host_cached,
            queue_s=(tracked.admitted or now) - seq.arrival,
            ttft_s=(first - seq.arrival) if first else 0.0, e2e_s=now - seq.arrival,
            num_disk_cached_tokens=seq.num_disk_cached, uncached=seq.uncached)
        self.recent.append(record)
        resumed = seq.request.resumed_output  # a continuation: output another engine wrote
        num_new = num_out - len(resumed or ())
        itl = (now - first) / (num_new - 1) if first and num_new > 1 else 0.0
        log = self.log.warning if out.finish_reason == "error" else self.log.info
        log("request_done", request_id=record.request_id, session=record.session or None,
            finish_reason=record.finish_reason, prompt_tokens=record.num_prompt_tokens,
            output_tokens=num_out, device_cached_tokens=record.num_device_cached_tokens,
            host_cached_tokens=record.num_host_cached_tokens,
            disk_cached_tokens=record.num_disk_cached_tokens,
            preemptions=seq.num_preemptions, queue_s=round(record.queue_s, 4),
            ttft_s=round(record.ttft_s, 4), itl_s=round(itl, 5), e2e_s=round(record.e2e_s, 4),
            **_miss_fields(seq.uncached),
            **({"resumed_tokens": len(resumed)} if resumed is not None else {}),
            **({"error": out.error} if out.error else {}))

    def prefix_break(self, report: PrefixBreak) -> None:
        report.time = report.time or time.time()
        self.prefix_breaks.append(report)
        self.log.info("prefix_break", session=report.session, request_id=report.request_id,
                      common_tokens=report.num_common_tokens,
                      prompt_tokens=report.num_prompt_tokens, reason=report.reason)


def _miss_fields(uncached: UncachedTokens | None) -> dict[str, object]:
    """The request_done fields that say why its uncached prompt tokens were computed:
    the main reason, the tokens of each reason that has some (uncached_<reason>), and
    the first evicted block's tier, age and cause, or where the prompt diverged."""
    if uncached is None:  # never admitted, or prefix caching off
        return {}
    fields: dict[str, object] = {"uncached_tokens": uncached.num_tokens,
                                 "miss_reason": uncached.main_reason or None}
    fields.update({f"uncached_{reason}": n for reason, n in uncached.by_reason().items() if n})
    if uncached.evicted:
        fields.update(evicted_tier=uncached.evicted_tier, evicted_age_s=uncached.evicted_age_s,
                      evicted_by=uncached.evicted_by)
    if uncached.diverged_at >= 0:
        fields["diverged_at"] = uncached.diverged_at
    return fields


def summarize(plan: StepPlan) -> PlanSummary:
    d = plan.decodes
    chunks = [ChunkSummary(s, p, 1, True) for s, p in zip(d.seq_ids, d.start_pos)]
    chunks += [ChunkSummary(c.seq_id, c.start_pos, len(c.token_ids), c.sample)
               for c in plan.chunks]
    # a drafted decode (speculative decoding) runs its drafts as decode tokens too
    decode = len(d) + sum(1 + c.num_draft for c in plan.chunks
                          if c.sample and len(c.token_ids) == 1 + c.num_draft)
    return PlanSummary(
        step=plan.step, time=time.time(), duration_s=0.0, close=list(plan.close),
        new_seqs=[s.seq_id for s in plan.new_seqs],
        num_append_blocks=sum(len(a.block_ids) for a in plan.append),
        num_new_blocks=sum(len(s.block_ids) for s in plan.new_seqs),
        num_swap_out=len(plan.swap_out), num_swap_in=len(plan.swap_in),
        num_register=len(plan.register),
        num_prefill_tokens=sum(c.num_tokens for c in chunks) - decode,
        num_decode_tokens=decode, chunks=chunks)
