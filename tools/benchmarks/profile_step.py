"""The engine's own CPU cost per step, scheduler and a null-model rank in one process.

    python -m tools.benchmarks.profile_step --model models/tiny-llama [--batch 64]
        [--modes decode,mixed] [--steps 200] [--profile OUT_PREFIX] [--no-async-scheduling]

`make bench-overhead` (tools/benchmarks/overhead.py) runs the ranks as processes and measures
wall time, which on a small, shared machine is mostly whoever else holds the cores. This
runs the same cells (its workload and driver) with the scheduler and one null-model rank
(zero forward) in this process, every message still through the codec both ways (the plan
encoded and decoded, the result encoded and decoded, as over the socket), and measures CPU
time per step, split into the scheduler's parts and the rank's. The clock is this thread's
(time.thread_time): everything runs in it, and the process's clock, which sums every
thread, cost up to half a millisecond a reading on a loaded machine.
`--profile PREFIX` writes a cProfile of each cell's measured steps to PREFIX-<mode>.prof.
"""

from __future__ import annotations

import argparse
import cProfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.engine import EngineCore, agree_limits
from scheduler.scheduler import Scheduler
from tools.benchmarks.overhead import (
    BLOCK_SIZE,
    DECODE_SLACK,
    MAX_MODEL_LEN,
    NULL_BLOCK_BYTES_PER_LAYER,
    Driver,
    Workload,
    warm_pool,
)
from wire import codec
from wire.config import EngineConfig
from wire.gc_policy import settle_heap
from wire.lifecycle import WorkerReady
from wire.step import StepPlan, StepResult
from worker.distributed import TensorParallelGroup, resolve_device
from worker.inprocess import ready_message
from worker.model_runner import ModelRunner

# CPU seconds per named part, summed over the measured steps
CpuParts = defaultdict[str, float]


def timed(parts: CpuParts, name: str, fn: Callable) -> Callable:
    """`fn`, its CPU time added to parts[name] on every call."""
    def wrapper(*args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] += time.thread_time() - t
    return wrapper


@dataclass
class WireExecutor:
    """The executor interface (scheduler/executor.py) over a rank in this process, every
    plan and result through the codec as over the socket; a plan runs at its collect."""

    config: EngineConfig
    parts: CpuParts
    runner: ModelRunner | None = None
    _frames: list[bytes] = field(default_factory=list)

    def start(self) -> list[WorkerReady]:
        device = resolve_device(self.config.device, 0)
        self.runner = ModelRunner(self.config, TensorParallelGroup(0, 1), device)
        return [ready_message(self.runner, 0)]

    def submit(self, plan: StepPlan) -> None:
        t = time.thread_time()
        self._frames.append(codec.encode(plan))
        self.parts["sched encode"] += time.thread_time() - t

    def collect(self) -> list[StepResult]:
        p, clock = self.parts, time.thread_time
        t0 = clock()
        plan = codec.decode(self._frames.pop(0))
        t1 = clock()
        step = self.runner.prepare(plan)
        t2 = clock()
        self.runner.launch(step)
        out = self.runner.finish(step)
        t3 = clock()
        frame = codec.encode(StepResult(plan.step, 0, out.digest, out.sampled, out.timing,
                                        sampled_digest=out.sampled_digest))
        t4 = clock()
        result = codec.decode(frame)
        t5 = clock()
        p["rank decode"] += t1 - t0
        p["rank prepare"] += t2 - t1
        p["rank forward+finish"] += t3 - t2
        p["rank encode"] += t4 - t3
        p["sched result decode"] += t5 - t4
        return [result]

    def step(self, plan: StepPlan) -> list[StepResult]:
        self.submit(plan)
        return self.collect()

    def shutdown(self) -> None:
        self.runner = None


def build(args: argparse.Namespace, parts: CpuParts) -> EngineCore:
    from worker.gguf import load_config

    num_layers = load_config(args.model).num_layers
    block_bytes = num_layers * NULL_BLOCK_BYTES_PER_LAYER
    longest = 32 + 32 + 72 + args.steps + DECODE_SLACK
    num_device_blocks = args.batch * -(-longest // BLOCK_SIZE) + 64
    config = EngineConfig(
        model=args.model, world_size=1, dtype="float32", block_size=BLOCK_SIZE,
        null_model_forward_ms=0.0, max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=num_device_blocks * block_bytes,
        host_cache_memory=args.host_blocks * block_bytes,
        max_num_seqs=args.batch, max_num_batched_tokens=2048,
        async_scheduling=not args.no_async_scheduling)
    executor = WireExecutor(config, parts)
    core = EngineCore(Scheduler(config, agree_limits(executor.start())), executor)
    if not args.profile:  # under cProfile the timers would be most of what it sees
        time_parts(core, executor.runner, parts)
    settle_heap()
    return core


def time_parts(core: EngineCore, runner: ModelRunner, parts: CpuParts) -> None:
    sched = core.scheduler
    sched.schedule = timed(parts, "sched plan", sched.schedule)
    sched.update = timed(parts, "sched update", sched.update)
    sched.check_accounting = timed(parts, "sched check", sched.check_accounting)
    runner._prepare_batch = timed(parts, "rank inputs", runner._prepare_batch)
    runner._apply_cache_ops = timed(parts, "rank cache ops", runner._apply_cache_ops)
    runner._apply_table_deltas = timed(parts, "rank table deltas", runner._apply_table_deltas)
    runner.digest.apply = timed(parts, "rank digest", runner.digest.apply)
    sched.digest.apply = timed(parts, "sched digest", sched.digest.apply)
    sched.cache.allocate = timed(parts, "sched allocate", sched.cache.allocate)
    if hasattr(sched.cache, "grow"):
        sched.cache.grow = timed(parts, "sched grow", sched.cache.grow)
    sched.cache.take_ops = timed(parts, "sched take_ops", sched.cache.take_ops)


def run_cell(driver: Driver, mode: str, args: argparse.Namespace,
             parts: CpuParts) -> tuple[float, int, cProfile.Profile | None]:
    batch = args.batch
    if mode == "decode":
        for _ in range(batch):
            driver.submit(args.steps + DECODE_SLACK)
        for _ in range(10_000):
            summary = driver.step().summary
            if summary.num_prefill_tokens == 0 and len(summary.chunks) == batch:
                break
        warmup = 5
    else:
        for i in range(batch):
            driver.submit(1 + i * 16 // batch)
        driver.refill_tokens = 16
        warmup = 16 + 5
    for _ in range(warmup):
        driver.step()
    parts.clear()
    prof = cProfile.Profile() if args.profile else None
    t0 = time.thread_time()
    if prof is not None:
        prof.enable()
    for _ in range(args.steps):
        driver.step()
    if prof is not None:
        prof.disable()
    cpu = time.thread_time() - t0
    driver.drain()
    return cpu, args.steps, prof


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--modes", default="decode,mixed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3, help="cells per mode; the best is shown")
    p.add_argument("--host-blocks", type=int, default=16384)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--profile", default=None, help="write PREFIX-<mode>.prof (cProfile)")
    args = p.parse_args(argv)
    parts: CpuParts = defaultdict(float)
    core = build(args, parts)
    num_conversations = max(8, core.scheduler.limits.num_device_blocks // 4)
    driver = Driver(core, Workload(num_conversations, core.scheduler.limits.vocab_size))
    warm_pool(driver)
    print(f"in process, world size 1, batch {args.batch}, null model (0 ms), overlap "
          f"{'off' if args.no_async_scheduling else 'on'}: CPU ms per step "
          f"(best of {args.repeat} x {args.steps} steps; parts of that run)")
    for mode in (m for m in args.modes.split(",") if m):
        best = None
        for _ in range(args.repeat):
            cpu, n, prof = run_cell(driver, mode, args, parts)
            if best is None or cpu < best[0]:
                best = (cpu, n, dict(parts), prof)
        cpu, n, cell_parts, prof = best
        print(f"{mode}: {1000 * cpu / n:.3f} ms")
        for name, s in sorted(cell_parts.items(), key=lambda kv: -kv[1]):
            print(f"  {name:24s} {1000 * s / n:.3f}")
        if prof is not None:
            prof.dump_stats(f"{args.profile}-{mode}.prof")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
