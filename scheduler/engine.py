"""One engine step: plan, run on every rank, check the ranks agree, collect outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cache.manager import CacheAccountingError
from scheduler.executor import Executor
from scheduler.scheduler import Scheduler
from wire.client import EngineStats, RequestOutput
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
class StepTimings:
    """Seconds per part of the last step, for the engine benchmark and metrics."""

    schedule: float = 0.0
    execute: float = 0.0  # wall time of the executor call (IPC + forward + wait)
    forward: float = 0.0  # rank 0's own forward pass
    update: float = 0.0
    num_tokens: int = 0
    num_prefill_tokens: int = 0  # totals since start
    num_decode_tokens: int = 0
    totals: dict[str, float] = field(default_factory=dict)


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
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.timings = StepTimings()

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        results = self.executor.step(plan)
        t2 = time.perf_counter()
        check_digests(plan.step, self.scheduler.digest.value, results)
        outputs = self.scheduler.update(plan, results[0].sampled)
        check_cache(self.scheduler, plan.step)
        t3 = time.perf_counter()
        tm = self.timings
        tm.schedule, tm.execute, tm.update = t1 - t0, t2 - t1, t3 - t2
        tm.forward = results[0].forward_s
        tm.num_tokens = sum(len(c.token_ids) for c in plan.chunks)
        decodes = sum(1 for c in plan.chunks if len(c.token_ids) == 1 and c.sample)
        tm.num_decode_tokens += decodes
        tm.num_prefill_tokens += tm.num_tokens - decodes
        for key in ("schedule", "execute", "forward", "update", "num_tokens"):
            tm.totals[key] = tm.totals.get(key, 0.0) + getattr(tm, key)
        return outputs

    def stats(self) -> EngineStats:
        sched, tm = self.scheduler, self.timings
        return EngineStats(
            step=sched.step,
            num_waiting=len(sched.queue),
            num_running=len(sched.running),
            num_prefill_tokens=tm.num_prefill_tokens,
            num_decode_tokens=tm.num_decode_tokens,
            step_seconds=tm.totals.get("schedule", 0.0) + tm.totals.get("execute", 0.0)
            + tm.totals.get("update", 0.0),
            kv_bytes_per_block=sched.limits.kv_bytes_per_block,
            cache={k: int(v) for k, v in vars(sched.cache.stats).items()},
            usage=sched.cache.usage(),
        )
