"""One engine step: plan, run on every rank, check the ranks agree, collect outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cache.manager import CacheAccountingError
from scheduler.executor import Executor
from scheduler.scheduler import Scheduler
from scheduler.telemetry import StepRecord, Telemetry, summarize
from wire.client import EngineStats
from wire.lifecycle import EngineLimits, WorkerReady
from wire.step import StepResult


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
    time and token counters, and the engine benchmark's per-step figures."""

    schedule_s: float = 0.0
    execute_s: float = 0.0
    forward_s: float = 0.0
    update_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def add(self, record: StepRecord) -> None:
        self.schedule_s += record.schedule_s
        self.execute_s += record.execute_s
        self.forward_s += record.forward_s
        self.update_s += record.update_s
        self.num_prefill_tokens += record.summary.num_prefill_tokens
        self.num_decode_tokens += record.summary.num_decode_tokens


def agree_limits(ready: list[WorkerReady]) -> EngineLimits:
    """The engine's limits: every rank must report the same (each took the minimum block
    counts over the ranks before it said it was ready)."""
    first = ready[0].limits
    for r in ready[1:]:
        assert r.limits == first, f"rank {r.rank} reports {r.limits}, rank 0 {first}"
    return first


def check_digests(step: int, expected: int, results: list[StepResult]) -> None:
    """Every rank must hold exactly the state the scheduler planned."""
    bad = [r for r in results if r.digest != expected]
    if bad:
        good = [r.rank for r in results if r.digest == expected]
        detail = ", ".join(f"rank {r.rank} has {r.digest:#018x}" for r in bad)
        raise RankDivergenceError(
            f"rank state diverged at step {step}: scheduler expects {expected:#018x}; "
            f"{detail}; agreeing ranks: {good or 'none'}")


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor,
                 telemetry: Telemetry | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.telemetry = telemetry
        self.totals = StepTotals()

    def step(self) -> StepRecord:
        """Plan, run on every rank, check them, apply rank 0's tokens. The record's
        summary is made between the plan and the run, outside every timed part."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        schedule_s = time.perf_counter() - t0
        record = StepRecord(summarize(plan), schedule_s=schedule_s)
        if self.telemetry is not None:
            self.telemetry.step_started(record)
        t1 = time.perf_counter()
        results = self.executor.step(plan)
        t2 = time.perf_counter()
        check_digests(plan.step, self.scheduler.digest.value, results)
        record.outputs = self.scheduler.update(plan, results[0].sampled)
        check_cache(self.scheduler, plan.step)
        record.execute_s, record.update_s = t2 - t1, time.perf_counter() - t2
        record.forward_s = results[0].forward_s
        self.totals.add(record)
        if self.telemetry is not None:
            self.telemetry.step_done(record)
        return record

    def stats(self) -> EngineStats:
        sched, tot = self.scheduler, self.totals
        return EngineStats(
            step=sched.step,
            num_waiting=len(sched.queue),
            num_running=len(sched.running),
            num_prefill_tokens=tot.num_prefill_tokens,
            num_decode_tokens=tot.num_decode_tokens,
            step_seconds=tot.schedule_s + tot.execute_s + tot.update_s,
            kv_bytes_per_block=sched.limits.kv_bytes_per_block,
            cache={k: int(v) for k, v in vars(sched.cache.stats).items()},
            usage=sched.cache.usage(),
        )
