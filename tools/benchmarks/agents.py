"""Coding-agent workload against the engine, prefix cache on and off, in one run.

    python -m tools.benchmarks.agents --model models/tiny-llama [--world-size 4] [--agents 4]
        [--system-tokens 1024] [--turns 6] [--tool-tokens 64] [--output-tokens 16]
        [--host-cache-memory BYTES] [--state-snapshot-interval K] [--stagger-s S]
        [--max-model-len N] [--caching on,off] [--json OUT]

Each agent shares one long system prompt, then resends its whole growing history
every turn (previous prompt + its answer + a new tool result), as Claude Code does.
Driven through the real scheduler and real ranks (ZeroMQ, no HTTP). Reports the
share of prompt tokens served per tier, prompt tokens read per second (cached
tokens count as read), its on/off ratio, time to first token p50/p95, the prompt
tokens computed by reason (wire/client.py UNCACHED_REASONS: `no_state` is a hybrid
model's hit cut back to its last linear-attention state snapshot) and, for a hybrid
model, the state slots' share of the device tier.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from orchestrator.config import snapshot_interval_arg
from orchestrator.launcher import stop_all
from scheduler.engine import EngineCore, agree_limits
from scheduler.executor import ZmqExecutor
from scheduler.scheduler import Scheduler
from tools.benchmarks.machine import describe, print_summary
from tools.harness.local_ranks import spawn_local_ranks
from wire.client import UNCACHED_REASONS, GenerateRequest
from wire.config import EngineConfig
from wire.gc_policy import settle_heap
from wire.lifecycle import EngineLimits


@dataclass
class Agent:
    name: str
    history: list[int]
    turn: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    in_flight: bool = False
    ready_at: float = 0.0  # thinking until then (wall clock)
    output: list[int] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_workload(core: EngineCore, args: argparse.Namespace, progress: tqdm) -> dict:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, 8000) for _ in range(args.system_tokens)]
    agents = [Agent(f"agent{i}", system + [rng.randrange(10, 8000) for _ in range(48)],
                    ready_at=time.perf_counter() + i * args.stagger_s)
              for i in range(args.agents)]
    ttfts: list[float] = []
    prompt_tokens = device_hits = host_hits = 0
    uncached = dict.fromkeys(UNCACHED_REASONS, 0)
    start = time.perf_counter()
    while any(a.turn < args.turns for a in agents) or core.has_work():
        # an agent's pause does not count in its TTFT: it is measured from submission
        now = time.perf_counter()
        for a in agents:
            if not a.in_flight and a.turn < args.turns and now >= a.ready_at:
                a.in_flight, a.first_token_at, a.output = True, None, []
                a.submitted_at = time.perf_counter()
                core.scheduler.add_request(GenerateRequest(
                    f"{a.name}-{a.turn}", list(a.history), args.output_tokens, ignore_eos=True))
        if not core.has_work():
            time.sleep(0.01)  # every agent is thinking
            continue
        by_id = {f"{a.name}-{a.turn}": a for a in agents}
        for out in core.step().outputs:
            a = by_id[out.request_id]
            if a.first_token_at is None and out.token_ids:
                a.first_token_at = time.perf_counter()
                ttfts.append(a.first_token_at - a.submitted_at)
            a.output.extend(out.token_ids)
            if out.finished and out.uncached is not None:
                for reason, n in out.uncached.by_reason().items():
                    uncached[reason] += n
            if out.finished:
                prompt_tokens += out.num_prompt_tokens
                device_hits += out.num_device_cached_tokens
                host_hits += out.num_host_cached_tokens
                tool_result = [rng.randrange(10, 8000) for _ in range(args.tool_tokens)]
                a.history = a.history + a.output + tool_result
                a.turn += 1
                a.in_flight = False
                a.ready_at = time.perf_counter() + rng.uniform(0, 2 * args.think_s)
                progress.update(1)
    wall = time.perf_counter() - start
    return {
        "prompt_tokens": prompt_tokens,
        "device_hit_share": device_hits / prompt_tokens,
        "host_hit_share": host_hits / prompt_tokens,
        "cached_share": (device_hits + host_hits) / prompt_tokens,
        "prompt_tokens_read_per_s": prompt_tokens / wall,
        "wall_s": wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p95_ms": 1000 * percentile(ttfts, 0.95),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "uncached_tokens": uncached,
    }


def device_tier(limits: EngineLimits) -> dict:
    """What a rank's device tier holds: KV blocks, and a hybrid model's state slots."""
    kv = limits.num_device_blocks * limits.kv_bytes_per_block
    state = limits.num_state_slots * limits.state_bytes_per_slot
    return {"num_device_blocks": limits.num_device_blocks,
            "num_state_slots": limits.num_state_slots, "kv_bytes": kv, "state_bytes": state,
            "state_share": state / (kv + state)}


def start_engine(args: argparse.Namespace, run_dir: str, caching: bool):
    config = EngineConfig(model=args.model, world_size=args.world_size, dtype="float32",
                          kv_cache_memory=args.kv_cache_memory,
                          host_cache_memory=args.host_cache_memory,
                          enable_prefix_caching=caching,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          state_snapshot_interval=args.state_snapshot_interval,
                          **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    address = f"ipc://{run_dir}/workers-{int(caching)}.sock"
    executor = ZmqExecutor(address, config)
    ranks = spawn_local_ranks(address, args.world_size)
    limits = agree_limits(executor.start())
    core = EngineCore(Scheduler(config, limits), executor)
    settle_heap()  # as the scheduler process does before it serves
    return core, executor, ranks, limits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tool-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=0.0,
                   help="mean pause between an agent's turns (uniform 0..2x), so some "
                        "sessions go idle while others run")
    p.add_argument("--kv-cache-memory", type=int, default=0,
                   help="bytes per rank (0: sized from the model, as the engine does)")
    p.add_argument("--host-cache-memory", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=0,
                   help="0: the model's (a small --kv-cache-memory must hold one such sequence)")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="agent i starts i times this late (0: all in the first step)")
    p.add_argument("--caching", default="on,off",
                   help="the runs: prefix cache on, off, or both (the on/off ratios)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--state-snapshot-interval", type=snapshot_interval_arg, default="auto",
                   help="a hybrid model's snapshot of its linear-attention state every K "
                        "blocks; auto (the default): the engine's choice from the bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    runs = args.caching.split(",")
    assert set(runs) <= {"on", "off"}, f"--caching: on, off or both, not {args.caching}"
    results = {}
    with tempfile.TemporaryDirectory(prefix="deepinfer-agents-") as run_dir, \
            tqdm(total=len(runs) * args.agents * args.turns, desc="agent turns") as progress:
        for caching in (run == "on" for run in runs):
            core, executor, ranks, limits = start_engine(args, run_dir, caching)
            try:
                results["on" if caching else "off"] = run_workload(core, args, progress)
                results["on" if caching else "off"]["device_tier"] = device_tier(limits)
            finally:
                executor.shutdown()
                stop_all(ranks)

    table = Table(title=f"{args.agents} agents x {args.turns} turns, {args.system_tokens}-token "
                        f"shared system prompt, world size {args.world_size}")
    for col in ("prefix cache", "prompt tokens", "from device", "from host", "read tok/s",
                "TTFT p50 ms", "TTFT p95 ms", "wall s"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, str(r["prompt_tokens"]), f"{100 * r['device_hit_share']:.1f}%",
                      f"{100 * r['host_hit_share']:.1f}%", f"{r['prompt_tokens_read_per_s']:.0f}",
                      f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p95_ms']:.0f}", f"{r['wall_s']:.1f}")
    console = Console(width=140)
    machine = describe(measure=False)
    print_summary(console, machine)
    console.print(table)
    on, off = results.get("on"), results.get("off")
    if on:
        computed = {k: n for k, n in on["uncached_tokens"].items() if n}
        console.print("prompt tokens computed with the cache on, by reason: "
                      + (", ".join(f"{k} {n}" for k, n in computed.items()) or "none"))
    if limits.is_hybrid and on:
        tier = on["device_tier"]
        console.print(f"hybrid, a state snapshot every {limits.state_snapshot_interval} blocks: "
                      f"{tier['num_state_slots']} state slots "
                      f"({tier['state_bytes'] / 2**20:.1f} MiB) beside "
                      f"{tier['num_device_blocks']} KV blocks: state "
                      f"{100 * tier['state_share']:.1f}% of the device tier")
    ratio = None
    if on and off:
        ratio = on["prompt_tokens_read_per_s"] / off["prompt_tokens_read_per_s"]
        console.print(f"read-rate ratio cache on/off: {ratio:.2f}x; "
                      f"TTFT p50 ratio off/on: {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results,
                       "read_rate_ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
