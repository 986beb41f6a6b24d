"""Engine overhead: what the engine costs per step by itself, with the null model.

    python -m tools.benchmarks.overhead --model models/tiny-llama [--world-sizes 1,2,4]
        [--batches 1,16,64,256] [--modes decode,mixed] [--steps 200] [--json OUT]
        [--idle-forward-ms 5] [--idle-batch 64] [--idle-world-sizes 1,4]

The ranks run the null model (worker/null_model.py): no weights, a forward that sleeps a
chosen time (0 here) and deterministic tokens, with the real scheduler, cache and host
tier, step protocol, digests, ZeroMQ sockets and rank processes around it. On a GPU a
decode step is a few milliseconds, so what the engine spends around the forward decides
how much of the GPU it wastes; this measures it apart from any model.

Per world size (one engine each) and batch, two cells of `--steps` measured steps:
- decode: `batch` sequences all decoding (every plan has `batch` one-token chunks; as
  they grow, their new blocks evict cached ones, so plans carry swap_outs);
- mixed: `batch` requests live at once, each ending after `--output-tokens` tokens and
  replaced at once by a new one, so every step mixes decodes with prefill chunks. Each
  prompt is a shared system prefix (device hits), a conversation from a pool too large
  for the device tier (host hits: swap_ins) and fresh tokens (prefill).
The cache counters (hits per tier, blocks swapped) are read before and after each
window, and the table shows them per step.

Each step is split (ms per step, scheduler/engine.py StepTotals.breakdown) into planning,
the scheduler's digest prediction, plan encoding, the ranks' decode, apply (cache ops,
table deltas), digest and batch inputs, transport (sockets both ways, the ranks' result
encoding, wake-ups; not measurable with overlap, where a plan waits at the ranks while
they run the step before: "-"), waiting (for the slowest rank; with overlap, the time the
scheduler blocked for results), result handling (decode, tokens,
outputs), checks (digests compared, cache accounting) and the rest. Engine time is the
step less the forward. The ranks' idle time between forwards is measured on the ranks
(RankTiming.gap_s); with `--idle-forward-ms` (5 by default) extra engines measure it
beside a forward of that length, the figure overlap scheduling is to cut.

CPU time per step (time.thread_time) sits beside the wall times: the scheduler thread's
("sched cpu") and a rank main thread's, the mean over the ranks ("rank cpu"). Where the
processes outnumber the cores (world size 4 on 2 cores) they take turns, and the step
cannot be shorter than their CPU per step spread over the cores, nor than the busiest
process's own: "cpu bound" = max(sched cpu, rank cpu, (sched cpu + ws x rank cpu) / cores),
in ms. With a core per process (a GPU node) only the second term is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from orchestrator.launcher import stop_all
from scheduler.engine import EngineCore, StepTotals, agree_limits
from scheduler.executor import ZmqExecutor
from scheduler.scheduler import Scheduler
from tools.harness.local_ranks import spawn_local_ranks
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.cpu_policy import defer_to_ranks
from wire.gc_policy import settle_heap
from worker.null_model import NULL_HEAD_DIM, NULL_KV_HEADS

RESULTS_DIR = Path("bench-results")
BLOCK_SIZE = 16
SYSTEM_TOKENS = 32  # two blocks every prompt starts with: device hits
CONVERSATION_TOKENS = 32  # two blocks from the conversation pool: host hits
SUFFIX_TOKENS = (8, 72)  # fresh tokens after them [lo, hi): prefill, spread block crossings
PROMPT_MAX = SYSTEM_TOKENS + CONVERSATION_TOKENS + SUFFIX_TOKENS[1]
DECODE_SLACK = 64  # a decode cell's max_tokens beyond its steps: admission, warm-up
MAX_MODEL_LEN = 1024
# A null-model KV block per layer (worker/null_model.py): K and V, 16 tokens, one head of
# one float32 element. The tiers are sized in blocks, from this.
NULL_BLOCK_BYTES_PER_LAYER = 2 * BLOCK_SIZE * NULL_KV_HEADS * NULL_HEAD_DIM * 4


@dataclass(frozen=True)
class EngineSpec:
    world_size: int
    forward_ms: float
    batches: tuple[int, ...]
    modes: tuple[str, ...]


class Workload:
    """The prompts: a shared system prefix, a conversation from a pool, fresh tokens.
    Conversations are taken in turn, so by the time one comes back the device tier has
    churned through several times its size and it is found in the host tier."""

    def __init__(self, num_conversations: int, vocab_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.system = self._tokens(SYSTEM_TOKENS)
        self.conversations = [self._tokens(CONVERSATION_TOKENS)
                              for _ in range(num_conversations)]
        self.num_requests = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab_size) for _ in range(n)]

    def request(self, max_tokens: int) -> GenerateRequest:
        conversation = self.conversations[self.num_requests % len(self.conversations)]
        suffix = self._tokens(self.rng.randrange(*SUFFIX_TOKENS))
        self.num_requests += 1
        return GenerateRequest(f"q{self.num_requests}", self.system + conversation + suffix,
                               max_tokens, ignore_eos=True)


def device_blocks(args: argparse.Namespace, batches: tuple[int, ...]) -> int:
    """Room for the largest batch of decode-cell sequences at their longest, and a little:
    the rest of the tier is what the prefix cache churns through."""
    longest = PROMPT_MAX + args.steps + DECODE_SLACK
    return max(batches) * -(-longest // BLOCK_SIZE) + 64


@contextlib.contextmanager
def engine(model: str, spec: EngineSpec, args: argparse.Namespace,
           num_layers: int) -> Iterator[EngineCore]:
    """A scheduler in this process, `spec.world_size` null-model ranks over ZeroMQ."""
    block_bytes = num_layers * NULL_BLOCK_BYTES_PER_LAYER
    config = EngineConfig(
        model=model, world_size=spec.world_size, dtype="float32", block_size=BLOCK_SIZE,
        null_model_forward_ms=spec.forward_ms, max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=device_blocks(args, spec.batches) * block_bytes,
        host_cache_memory=args.host_blocks * block_bytes,
        max_num_seqs=max(spec.batches), max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=not args.no_async_scheduling, step_channel=args.step_channel,
        device=args.device)
    with tempfile.TemporaryDirectory(prefix="deepinfer-overhead-") as run_dir:
        address = f"ipc://{run_dir}/workers.sock"
        executor = ZmqExecutor(address, config, start_timeout_s=300)
        ranks = spawn_local_ranks(address, spec.world_size)
        try:
            core = EngineCore(Scheduler(config, agree_limits(executor.start())), executor)
            settle_heap()  # as the scheduler process does before it serves
            yield core
        finally:
            executor.shutdown()
            stop_all(ranks)


class Driver:
    """Submits requests, steps the engine, replaces finished requests (mixed cells)."""

    def __init__(self, core: EngineCore, work: Workload) -> None:
        self.core = core
        self.work = work
        self.live: set[str] = set()
        self.refill_tokens = 0  # > 0: a finished request is replaced by one this long

    def submit(self, max_tokens: int) -> None:
        req = self.work.request(max_tokens)
        self.core.scheduler.add_request(req)
        self.live.add(req.request_id)

    def step(self):
        record = self.core.step()
        for out in record.outputs:
            if out.finished:
                self.live.discard(out.request_id)
                if self.refill_tokens:
                    self.submit(self.refill_tokens)
        return record

    def drain(self) -> None:
        """Abort whatever is live and step until the engine is idle (the closes run)."""
        self.refill_tokens = 0
        for request_id in list(self.live):
            self.core.scheduler.abort_request(request_id)
        self.live.clear()
        while self.core.has_work():
            self.core.step()


def warm_pool(driver: Driver) -> None:
    """Every conversation once (one output token), so that the measured cells hit them."""
    sched = driver.core.scheduler
    remaining = len(driver.work.conversations)
    while remaining or driver.core.has_work():
        while remaining and len(driver.live) < sched.config.max_num_seqs:  # the queue is bounded
            driver.submit(1)
            remaining -= 1
        driver.step()


def run_cell(driver: Driver, batch: int, mode: str, args: argparse.Namespace) -> dict:
    core, sched = driver.core, driver.core.scheduler
    if mode == "decode":
        for _ in range(batch):
            driver.submit(args.steps + DECODE_SLACK)
        for _ in range(10_000):  # admission: until every sequence decodes
            summary = driver.step().summary
            if summary.num_prefill_tokens == 0 and len(summary.chunks) == batch:
                break
        warmup = args.warmup_steps
    else:
        m = args.output_tokens
        for i in range(batch):  # staggered ends: about batch / m replaced every step
            driver.submit(1 + i * m // batch)
        driver.refill_tokens = m
        warmup = m + args.warmup_steps
    for _ in range(warmup):
        driver.step()

    core.totals = StepTotals(overlap=core.overlap)
    before = replace(sched.cache.stats)
    swap_in = swap_out = chunks = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        summary = driver.step().summary
        swap_in += summary.num_swap_in
        swap_out += summary.num_swap_out
        chunks += len(summary.chunks)
    wall = time.perf_counter() - t0
    # taken before the drain, whose steps are not the cell's
    totals, after = core.totals, replace(sched.cache.stats)
    core.totals = StepTotals(overlap=core.overlap)
    driver.drain()

    n = max(1, totals.num_steps)
    queried = after.num_queried_tokens - before.num_queried_tokens
    device_hits = after.num_device_hit_tokens - before.num_device_hit_tokens
    host_hits = after.num_host_hit_tokens - before.num_host_hit_tokens
    parts = totals.breakdown()
    return {
        "mode": mode, "batch": batch, "steps": totals.num_steps,
        "steps_per_s": totals.num_steps / wall,
        "loop_ms": 1000 * wall / n,  # the step and the driver's requests between steps
        "between_ms": 1000 * wall / n - parts["step"],
        # NaN (transport under overlap: not measurable) is null in JSON
        "breakdown_ms": {k: None if math.isnan(v) else v for k, v in parts.items()
                         if k != "idle_share"},
        "idle_share": parts["idle_share"],
        "chunks_per_step": chunks / n,
        "prefill_tokens_per_step": totals.num_prefill_tokens / n,
        "decode_tokens_per_step": totals.num_decode_tokens / n,
        "swap_in_blocks_per_step": swap_in / n, "swap_out_blocks_per_step": swap_out / n,
        "counters": {  # the cache's own counters over the window
            "queried_tokens": queried, "device_hit_tokens": device_hits,
            "host_hit_tokens": host_hits,
            "swap_in_blocks": after.num_swap_in_blocks - before.num_swap_in_blocks,
            "swap_out_blocks": after.num_swap_out_blocks - before.num_swap_out_blocks},
    }


def run_engine(model: str, spec: EngineSpec, args: argparse.Namespace, num_layers: int,
               progress: tqdm) -> list[dict]:
    rows = []
    with engine(model, spec, args, num_layers) as core:
        num_conversations = max(8, device_blocks(args, spec.batches) // 4)
        driver = Driver(core, Workload(num_conversations, core.scheduler.limits.vocab_size))
        progress.set_postfix_str(f"world size {spec.world_size}: warming the cache")
        warm_pool(driver)
        for batch in spec.batches:
            for mode in spec.modes:
                progress.set_postfix_str(f"world size {spec.world_size}, forward "
                                         f"{spec.forward_ms:g} ms, batch {batch}, {mode}")
                row = run_cell(driver, batch, mode, args)
                rows.append({"world_size": spec.world_size, "forward_ms": spec.forward_ms,
                             **row})
                progress.update(1)
    return rows


def cpu_bound_ms(breakdown: dict[str, float], world_size: int, cores: int) -> float:
    """The shortest step the processes' CPU time allows on `cores` cores (module doc)."""
    sched, rank = breakdown["sched_cpu"], breakdown["rank_cpu"]
    return max(sched, rank, (sched + world_size * rank) / cores)


def print_table(rows: list[dict], console: Console) -> None:
    table = Table(title="Engine overhead, null model: ms per step (rank parts: mean over "
                        "the ranks)")
    cols = ("ws", "fwd ms", "batch", "mode", "steps/s", "step", "engine", "plan", "digest",
            "encode", "rank decode", "rank apply", "rank digest", "rank inputs", "transport",
            "waiting",
            "results", "checks", "other", "rank idle", "idle %", "sched cpu", "rank cpu",
            "cpu bound", "swap in/out", "hit dev/host")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        b = r["breakdown_ms"]
        c = r["counters"]
        q = max(1, c["queried_tokens"])
        table.add_row(
            str(r["world_size"]), f"{r['forward_ms']:g}", str(r["batch"]), r["mode"],
            f"{r['steps_per_s']:,.0f}", f"{b['step']:.3f}", f"{b['engine']:.3f}",
            f"{b['plan']:.3f}", f"{b['digest']:.3f}", f"{b['encode']:.3f}",
            f"{b['rank_decode']:.3f}", f"{b['rank_apply']:.3f}", f"{b['rank_digest']:.3f}",
            f"{b['rank_prepare']:.3f}",
            "-" if b["transport"] is None else f"{b['transport']:.3f}", f"{b['waiting']:.3f}",
            f"{b['result_decode'] + b['results']:.3f}", f"{b['check']:.3f}",
            f"{b['other']:.3f}", f"{b['idle']:.3f}", f"{100 * r['idle_share']:.1f}%",
            f"{b['sched_cpu']:.3f}", f"{b['rank_cpu']:.3f}",
            f"{r['cpu_bound_ms']:.3f}",
            f"{r['swap_in_blocks_per_step']:.1f}/{r['swap_out_blocks_per_step']:.1f}",
            f"{100 * c['device_hit_tokens'] / q:.0f}/{100 * c['host_hit_tokens'] / q:.0f}%")
    console.print(table)


def check_counters(rows: list[dict]) -> list[str]:
    """What the counters must show for the run to have measured what it says."""
    problems = []
    for r in rows:
        name = f"world size {r['world_size']}, batch {r['batch']}, {r['mode']}"
        if r["mode"] == "mixed" and r["prefill_tokens_per_step"] == 0:
            problems.append(f"{name}: no prefill chunk in the window")
        if r["mode"] == "decode" and r["prefill_tokens_per_step"]:
            problems.append(f"{name}: prefill in a decode-only window")
    mixed = [r for r in rows if r["mode"] == "mixed"]
    if mixed and not any(r["counters"]["swap_in_blocks"] for r in mixed):
        problems.append("no host-tier swap_in in any mixed window")
    if mixed and not any(r["counters"]["host_hit_tokens"] for r in mixed):
        problems.append("no host-tier hit in any mixed window")
    if rows and not any(r["counters"]["swap_out_blocks"] for r in rows):
        problems.append("no swap_out in any window")
    return problems


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama",
                   help="its config.json gives the vocabulary and layers; no weights are read")
    p.add_argument("--world-sizes", type=ints, default=(1, 2, 4))
    p.add_argument("--batches", type=ints, default=(1, 16, 64, 256))
    p.add_argument("--modes", default="decode,mixed")
    p.add_argument("--forward-ms", type=float, default=0.0,
                   help="the null model's forward time in the main cells")
    p.add_argument("--steps", type=int, default=200, help="measured steps per cell")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--output-tokens", type=int, default=16,
                   help="mixed cells: each request's length (batch / this replaced a step)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--host-blocks", type=int, default=16384)
    p.add_argument("--idle-forward-ms", type=float, default=5.0,
                   help="the forward time of the idle-time cells (0: none)")
    p.add_argument("--idle-batch", type=int, default=64)
    p.add_argument("--idle-world-sizes", type=ints, default=(1, 4))
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="no overlap: each step is planned after the ranks finished the last")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="the ranks' device: on a GPU the batch inputs and the KV tiers live "
                        "there (one GPU: world size 1)")
    p.add_argument("--scheduler-policy", choices=("batch", "normal"), default="batch",
                   help="the scheduler's CPU policy: SCHED_BATCH, as the engine's "
                        "(wire/cpu_policy.py), or the default one")
    p.add_argument("--step-channel", choices=("auto", "zmq", "shm"), default="auto",
                   help="plans and results over the ZeroMQ socket or shared memory "
                        "(EngineConfig.step_channel)")
    p.add_argument("--no-machine-rates", action="store_true",
                   help="skip measuring the matmul and copy rates (tests)")
    p.add_argument("--json", type=Path, default=None,
                   help="default: bench-results/bench_overhead-<time>.json")
    args = p.parse_args(argv)
    args.modes = tuple(m for m in args.modes.split(",") if m)
    if set(args.modes) - {"decode", "mixed"}:
        p.error("--modes takes decode and mixed")
    return args


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    from tools.benchmarks.machine import describe, print_summary, summary_line
    from worker.gguf import load_config

    args = parse_args(argv)
    console = console or Console(width=240)
    # the scheduler here runs in this process: under the policy scheduler/main.py sets
    sched_batch = args.scheduler_policy == "batch" and defer_to_ranks()
    num_layers = load_config(args.model).num_layers
    machine = describe(measure=not args.no_machine_rates)
    print_summary(console, machine)
    cores = os.cpu_count() or 1
    specs = [EngineSpec(ws, args.forward_ms, args.batches, args.modes)
             for ws in args.world_sizes]
    if args.idle_forward_ms > 0:
        specs += [EngineSpec(ws, args.idle_forward_ms, (args.idle_batch,), args.modes)
                  for ws in args.idle_world_sizes]
    if any(s.world_size + 1 > cores for s in specs):
        console.print(f"note: {cores} cores for the scheduler and up to "
                      f"{max(s.world_size for s in specs)} ranks: the CPU is oversubscribed, "
                      "so the larger world sizes measure contention as well as the engine")
    load_start = os.getloadavg()
    rows: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=sum(len(s.batches) * len(s.modes) for s in specs), desc="cells") as bar:
        for spec in specs:
            rows += run_engine(args.model, spec, args, num_layers, bar)
    elapsed = time.perf_counter() - t0
    load_end = os.getloadavg()

    for r in rows:
        r["cpu_bound_ms"] = cpu_bound_ms(r["breakdown_ms"], r["world_size"], cores)
    print_table(rows, console)
    console.print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in load_start)} "
                  f"at the start, {', '.join(f'{x:.2f}' for x in load_end)} at the end; "
                  f"{elapsed:.0f} s")
    for r in rows:
        if r["forward_ms"] == args.idle_forward_ms and args.idle_forward_ms > 0:
            console.print(f"forward {r['forward_ms']:g} ms, world size {r['world_size']}, "
                          f"batch {r['batch']}, {r['mode']}, overlap "
                          f"{'off' if args.no_async_scheduling else 'on'}: the ranks idle "
                          f"{r['breakdown_ms']['idle']:.2f} ms between forwards, "
                          f"{100 * r['idle_share']:.1f}% of their time")
    problems = check_counters(rows)
    for problem in problems:
        console.print(f"[bold red]warning:[/] {problem}")

    path = args.json or RESULTS_DIR / f"bench_overhead-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path)
                           else v) for k, v in vars(args).items()},
              "machine": machine, "machine_line": summary_line(machine),
              "load_avg_start": load_start, "load_avg_end": load_end, "elapsed_s": elapsed,
              "problems": problems, "scheduler_sched_batch": sched_batch, "results": rows}
    path.write_text(json.dumps(record, indent=2))
    console.print(f"results: {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
