"""One engine step: plan, run on every rank, check the ranks agree, collect outputs.

Overlap scheduling (EngineConfig.async_scheduling, on by default): the engine plans and
submits step k+1 before it collects step k, so each rank finds its next plan waiting when
it ends a step, and the scheduler's work (planning, encoding, results) hides behind the
ranks'. Step k+1 is planned without step k's samples: a sequence that decodes in both
names its step-k token PENDING_TOKEN, and every rank resolves it from the tokens it
sampled itself (all ranks sample from the same all-gathered logits, checked every step
by `check_samples`; worker/model_runner.py). What this changes, and what it does
not (scheduler/scheduler.py):

- a sequence learns that its token was final one step late, so it may run one token past
  its end: that step's sample is never emitted, its KV never committed to the prefix
  index (a block is committed only once its tokens are known), and the close comes in the
  plan after the last step that ran it, as the close-timing rule wants;
- an end known ahead (max_tokens, a full context) is never planned past: the plan after
  the step that samples the last token closes the sequence, and that token is emitted
  when its result comes (`Scheduler._close_ahead`);
- a step whose plan needs the previous token (a guided or thinking-budget sample's mask)
  is planned after the results come: no overlap for it (`Scheduler.needs_tokens`);
- the digest each rank must return is kept per plan in flight.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields

from cache.manager import CacheAccountingError
from scheduler.executor import ExchangeTiming, Executor
from scheduler.scheduler import Scheduler
from scheduler.telemetry import StepRecord, Telemetry, summarize
from wire.client import EngineStats
from wire.lifecycle import EngineLimits, WorkerReady
from wire.step import RankTiming, StepPlan, StepResult

_RANK_FIELDS = tuple(f.name for f in fields(RankTiming))


class RankDivergenceError(RuntimeError):
    """Ranks hold different cache state: never serve past this."""


def check_cache(scheduler: Scheduler, step: int) -> None:
    """The accounting check stays on in production (O(live sequences), with the rank
    digests); the full O(capacity) check walks every cached block in Python, a stall of
    seconds at deployment scale, so it runs only when asked for (debugging, tests). A
    violation stops the engine (CacheAccountingError) rather than serving wrong KV."""
    scheduler.check_accounting()
    every = scheduler.config.full_cache_check_every
    if every and step % every == every - 1:
        try:
            scheduler.cache.check_invariants()
        except AssertionError as exc:
            raise CacheAccountingError(f"cache invariant broken at step {step}: {exc}") from exc


@dataclass
class StepTotals:
    """Sums over every step since start (or since a benchmark reset them): /metrics' step
    time and token counters, and the engine benchmarks' per-step figures (`breakdown`)."""

    schedule_s: float = 0.0
    execute_s: float = 0.0
    forward_s: float = 0.0
    update_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_steps: int = 0
    step_s: float = 0.0
    digest_s: float = 0.0
    check_s: float = 0.0
    cpu_s: float = 0.0  # the scheduler thread's CPU time
    exchange: ExchangeTiming = field(default_factory=ExchangeTiming)  # sums; round trip per rank
    ranks: list[RankTiming] = field(default_factory=list)  # sums, per rank
    overlap: bool = False  # steps overlapped (EngineConfig.async_scheduling): see breakdown

    def add(self, record: StepRecord) -> None:
        self.schedule_s += record.schedule_s
        self.execute_s += record.execute_s
        self.forward_s += record.forward_s
        self.update_s += record.update_s
        self.num_prefill_tokens += record.summary.num_prefill_tokens
        self.num_decode_tokens += record.summary.num_decode_tokens
        self.num_steps += 1
        self.step_s += record.step_s
        self.digest_s += record.digest_s
        self.check_s += record.check_s
        self.cpu_s += record.cpu_s
        ex, tot = record.exchange, self.exchange
        if ex is not None:
            tot.encode_s += ex.encode_s
            tot.send_s += ex.send_s
            tot.decode_s += ex.decode_s
            tot.wait_s += ex.wait_s
            if not tot.round_trip_s:
                tot.round_trip_s = [0.0] * len(ex.round_trip_s)
            for r, s in enumerate(ex.round_trip_s):
                tot.round_trip_s[r] += s
        if not self.ranks:
            self.ranks = [RankTiming() for _ in record.ranks]
        for total, part in zip(self.ranks, record.ranks):
            for name in _RANK_FIELDS:
                setattr(total, name, getattr(total, name) + getattr(part, name))

    def breakdown(self) -> dict[str, float]:
        """Milliseconds per step, along the scheduler's path through a step; the parts from
        `plan` to `other` sum to `step`. A rank's parts are the mean over the ranks. Over
        ZeroMQ a rank's round trip (from handing its plan to ZeroMQ to its result in) is
        its own work (decode, apply, digest, prepare, forward) plus `transport`: the sockets
        both ways, the rank's result encoding, process wake-ups. `waiting` is what the
        scheduler waits beyond the mean rank's round trip: for the slowest rank (and, with
        several ranks, for the sends to the others). `idle` is the ranks' time
        between forwards (RankTiming.gap_s), `idle_share` its share of gap + forward.
        `sched_cpu` and `rank_cpu` are CPU time, the scheduler thread's and a rank's main
        thread's (RankTiming.cpu_s): where processes outnumber cores, their sum over the
        processes, not the wall time of one, is what bounds the step.

        With overlap a plan waits at the ranks while they finish the step before, so a
        round trip holds another step's work: `transport` cannot be told apart (NaN), the
        ranks' parts run beside the scheduler's, not in its path, and `waiting` is the time
        the scheduler spent sending and blocked for results: then the scheduler's parts
        (plan, digest, encode, waiting, result_decode, results, check, other) sum to
        `step`."""
        ms = 1000 / max(1, self.num_steps)
        ranks = self.ranks or [RankTiming()]

        def mean(name: str) -> float:
            return sum(getattr(r, name) for r in ranks) / len(ranks)

        work = {name: mean(name) for name in ("decode_s", "apply_s", "digest_s", "prepare_s",
                                              "forward_s")}
        handle = sum(work.values())
        ex = self.exchange
        if ex.round_trip_s and self.overlap:
            transport = float("nan")
            waiting = ex.wait_s - ex.decode_s  # the sends, then blocked for the results
            exchange_s = ex.encode_s + ex.wait_s
        elif ex.round_trip_s:  # over sockets
            round_trip = sum(ex.round_trip_s) / len(ex.round_trip_s)
            transport = round_trip - handle
            waiting = ex.wait_s - ex.decode_s - round_trip
            exchange_s = ex.encode_s + ex.wait_s
        else:  # in process: the executor call is the rank's work
            transport, waiting, exchange_s = 0.0, self.execute_s - handle, self.execute_s
        gap, forward = mean("gap_s"), work["forward_s"]
        parts = {
            "plan": self.schedule_s - self.digest_s,
            "digest": self.digest_s,
            "encode": ex.encode_s,
            "rank_decode": work["decode_s"],
            "rank_apply": work["apply_s"],
            "rank_digest": work["digest_s"],
            "rank_prepare": work["prepare_s"],
            "forward": forward,
            "transport": transport,
            "waiting": waiting,
            "result_decode": ex.decode_s,
            "results": self.update_s - self.check_s,
            "check": self.check_s,
            # the executor call's own remainder, the step's record and telemetry
            "other": self.step_s - self.schedule_s - self.update_s - exchange_s,
        }
        out = {k: v * ms for k, v in parts.items()}
        out.update(step=self.step_s * ms, engine=(self.step_s - forward) * ms,
                   rank_wait=mean("wait_s") * ms, idle=gap * ms,
                   sched_cpu=self.cpu_s * ms, rank_cpu=mean("cpu_s") * ms,
                   idle_share=gap / (gap + forward) if gap + forward else 0.0)
        return out


def agree_limits(ready: list[WorkerReady]) -> EngineLimits:
    """The engine's limits: every rank must report the same (each took the minimum block
    counts over the ranks before it said it was ready)."""
    first = ready[0].limits
    for r in ready[1:]:
        assert r.limits == first, f"rank {r.rank} reports {r.limits}, rank 0 {first}"
    return first


def restore_disk(scheduler: Scheduler, ready: list[WorkerReady]) -> None:
    """Warm restart: what the ranks agreed they hold on disk (each rank reports the same
    list; rank 0's is taken) goes into the scheduler's index and digest."""
    scheduler.restore_disk(ready[0].disk_found)
    scheduler.restore_disk_states(ready[0].state_disk_found)
    scheduler.disk_torn_at_start = max(r.disk_torn for r in ready)


def check_samples(step: int, results: list[StepResult]) -> None:
    """Under overlap scheduling every rank feeds the tokens it sampled itself to its next
    step (worker/model_runner.py): all must have sampled rank 0's. A rank that did not
    sample reports 0 (overlap off, or world size 1)."""
    first = results[0].sampled_digest
    bad = [r.rank for r in results if r.sampled_digest != first]
    if bad:
        raise RankDivergenceError(
            f"ranks {bad} sampled other tokens than rank 0 at step {step}: their next "
            "steps would run other inputs")


def check_digests(step: int, expected: int, results: list[StepResult]) -> None:
    """Every rank must hold exactly the state the scheduler planned."""
    bad = [r for r in results if r.digest != expected]
    if bad:
        good = [r.rank for r in results if r.digest == expected]
        detail = ", ".join(f"rank {r.rank} has {r.digest:#018x}" for r in bad)
        raise RankDivergenceError(
            f"rank state diverged at step {step}: scheduler expects {expected:#018x}; "
            f"{detail}; agreeing ranks: {good or 'none'}")


@dataclass
class _InFlight:
    """A plan submitted to the ranks whose results are not collected yet."""

    plan: StepPlan
    digest: int  # what every rank must hold after it (the scheduler's, when it was made)
    record: StepRecord
    submit_s: float


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor,
                 telemetry: Telemetry | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.telemetry = telemetry
        self.overlap = scheduler.config.async_scheduling
        self.totals = StepTotals(overlap=self.overlap)
        self._in_flight: deque[_InFlight] = deque()  # at most 2: running, and queued next
        self.disk_queue_depth = 0  # the busiest rank's disk write queue, last step

    def has_work(self) -> bool:
        """Requests to serve, or a step in flight to collect."""
        return bool(self._in_flight) or self.scheduler.has_work()

    def has_unreported_writes(self) -> bool:
        """Disk writes planned that not every rank has reported yet. A rank reports a write
        only in a step result, so an engine with nothing else to do still steps now and
        then (scheduler/main.py) until each is committed or dropped: else the last
        request's blocks would wait, pending, for the next request. A hybrid model's state
        snapshot records too (cache/state_disk.py)."""
        cache = self.scheduler.cache
        states = cache.state.disk if cache.state is not None else None
        return cache.disk.num_pending > 0 or (states is not None and states.pool.num_pending > 0)

    def step(self) -> StepRecord:
        """Complete one step: plan it (if not planned yet), and with overlap plan and submit
        the next before collecting it; check the ranks, apply rank 0's tokens. The record
        is the collected step's; its `step_s` is this call's."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if not self._in_flight:
            self._submit()
        sched = self.scheduler
        if self.overlap and len(self._in_flight) == 1 and sched.has_work() \
                and not sched.needs_tokens() and time.monotonic() >= sched.overlap_hold_until:
            self._submit()  # step k+1, planned and sent while the ranks run step k
        record = self._complete(self._in_flight.popleft())
        # the CPU interval nested in the wall one (read second, read first), so a busy
        # thread's CPU time never exceeds its step by the clock reads themselves
        record.cpu_s = time.thread_time() - cpu0
        record.step_s = time.perf_counter() - t0
        self.totals.add(record)
        return record

    def _submit(self) -> None:
        """Plan and send. The record's summary is made between the plan and the send,
        outside every timed part."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        schedule_s = time.perf_counter() - t0
        record = StepRecord(summarize(plan), schedule_s=schedule_s,
                            digest_s=self.scheduler.digest_s)
        if self.telemetry is not None:
            self.telemetry.step_started(record)
        t1 = time.perf_counter()
        self.executor.submit(plan)
        self._in_flight.append(_InFlight(plan, self.scheduler.digest.value, record,
                                         time.perf_counter() - t1))

    def _complete(self, f: _InFlight) -> StepRecord:
        plan, record = f.plan, f.record
        t1 = time.perf_counter()
        results = self.executor.collect()
        t2 = time.perf_counter()
        check_digests(plan.step, f.digest, results)
        check_samples(plan.step, results)
        for r in results:  # writes on every rank become readable, reads usable
            self.scheduler.cache.report_disk_writes(r.rank, r.disk_done, r.disk_dropped,
                                                    r.disk_read_done, r.disk_read_bad)
            self.scheduler.cache.report_state_disk(r.rank, r.state_disk_done,
                                                   r.state_disk_dropped,
                                                   r.state_disk_read_done,
                                                   r.state_disk_read_bad)
        self.disk_queue_depth = max(r.disk_queue_depth for r in results)
        t3 = time.perf_counter()
        record.outputs = self.scheduler.update(plan, results[0].sampled)
        t4 = time.perf_counter()
        check_cache(self.scheduler, plan.step)
        t5 = time.perf_counter()
        record.execute_s, record.update_s = f.submit_s + t2 - t1, t5 - t2
        record.check_s = (t3 - t2) + (t5 - t4)
        record.forward_s = results[0].timing.forward_s
        # in-process executors have no exchange
        record.exchange = getattr(self.executor, "last_exchange", None)
        record.ranks = [r.timing for r in results]
        if self.telemetry is not None:
            self.telemetry.step_done(record)
        return record

    def stats(self) -> EngineStats:
        sched, tot = self.scheduler, self.totals
        return EngineStats(
            step=sched.step,
            num_waiting=sched.num_waiting,
            num_running=len(sched.running),
            num_prefill_tokens=tot.num_prefill_tokens,
            num_decode_tokens=tot.num_decode_tokens,
            step_seconds=tot.schedule_s + tot.execute_s + tot.update_s,
            kv_bytes_per_block=sched.limits.kv_bytes_per_block,
            cache={k: int(v) for k, v in vars(sched.cache.stats).items()},
            usage=sched.cache.usage(),
            histograms=({"spec_accepted_drafts": sched.spec_stats.histogram(
                sched.speculative.num_speculative_tokens)}
                        if sched.speculative is not None else {}),
            num_spec_draft_tokens=sched.spec_stats.num_draft_tokens,
            num_spec_accepted_tokens=sched.spec_stats.num_accepted_tokens,
            disk=self._disk_stats(),
            state_usage=sched.cache.state_usage(),
        )

    def _disk_stats(self) -> dict[str, int]:
        disk = self.scheduler.cache.disk
        if not disk.num_slots:
            return {}
        return {"num_read_blocks": self.scheduler.cache.stats.num_disk_read_blocks,
                "num_committed_writes": disk.num_committed_writes,
                "num_dropped_writes": disk.num_dropped_writes,
                "num_pending_writes": disk.num_pending,
                "queue_depth": self.disk_queue_depth,
                "found_at_start": disk.num_found_at_start,
                "torn_at_start": self.scheduler.disk_torn_at_start}
