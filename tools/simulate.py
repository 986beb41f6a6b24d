"""Full-scale simulation: the real scheduler and cache in virtual time, no model.

    python -m tools.simulate                      # the 4x B200 deployment (100 agents, ~450K)
    python -m tools.simulate --agents 8 --context-tokens 20000 --turns 4   # small
    python -m tools.simulate --sweep              # host-tier size x write policy
    python -m tools.sim.retention            # cache_control retention vs plain LRU
    python -m tools.simulate --model-preset llama-3.1-8b --hardware-preset 4xb200 --honest
    python -m tools.sim.implied                   # what the deployment's figures imply
    python -m tools.simulate --disk-tokens 2000000000 --restart-at-s 1200   # disk tier

The scheduler, the prefix cache and the step protocol are the production code. Only
the ranks are replaced, by `CostModelExecutor`: it mirrors the plans exactly as a rank
does (its `StateDigest` must match the scheduler's every step, as real ranks must),
returns a token for every sampled chunk, and charges virtual time for each step from
a cost model: prefill seconds per computed token, decode seconds per step and per
sequence, swap seconds per block. Without presets the defaults are calibrated on the
deployment's raw read rate (~200,000 prompt tokens/s across the node); with
`--model-preset` and `--hardware-preset` the costs and the tiers' sizes come from bytes
and FLOPs (`tools/sim/costs.py`, `tools/sim/presets.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from scheduler.engine import EngineCore, agree_limits
from scheduler.scheduler import Scheduler
from tools.sim.costs import HardwareCostModel
from tools.sim.executor import CostModel, CostModelExecutor
from tools.sim.hardware_args import add_hardware_args, hardware_cost, print_capacities
from wire.client import GenerateRequest
from wire.config import EngineConfig

DEPLOYMENT = {"hit_ratio": 0.96, "read_rate_ratio": 9.0}


@dataclass
class Scenario:
    agents: int = 100
    context_tokens: int = 450_000  # each agent's conversation at the start
    shared_tokens: int = 20_000  # system prompt + tools, the same for every agent
    turns: int = 6
    turn_tokens: int = 2_000  # new tokens per turn (tool results, user text)
    output_tokens: int = 200
    active_wait_s: float = 5.0  # mean pause between turns of an active agent
    idle_wait_s: float = 600.0  # mean pause when the user is away
    idle_share: float = 0.3  # share of pauses that are idle waits
    seed: int = 0
    # Each agent's first turn reads its whole 450K context cold. The deployment's figures
    # are of a running system whose sessions were already cached, so by default the
    # report counts steady-state turns (the first turn still runs and fills the cache).
    count_first_turn: bool = False
    # Developers keep several sessions open and switch between them after a break, so
    # more context is alive than the device tier holds (the host tier's reason to be).
    sessions_per_agent: int = 3
    # Token ids are drawn below this. Ids under 256 are shared small ints in CPython, so
    # hundreds of 450K-token histories fit in memory; block hashes stay distinct.
    vocab_size: int = 256
    # What the deployment's traffic has and the default scenario lacks (`--honest` sets
    # them): after a turn, a share of agents opens a brand-new session (the shared prefix
    # and `new_session_tokens` of its own, a first turn: a miss but for the prefix)...
    new_session_share: float = 0.0
    new_session_tokens: int = 30_000
    # ...Claude Code compacts a share of histories: the conversation is replaced by a
    # summary, so the prefix breaks after the shared system prompt and tools...
    compaction_share: float = 0.0
    compacted_tokens: int = 40_000
    # ...and a share of pauses are long (overnight, a meeting): everyone else's traffic
    # in between pushes the session down the tiers.
    long_idle_share: float = 0.0
    long_idle_s: float = 7_200.0
    # At this virtual time the engine restarts: the device and host tiers lose what they
    # cached (what running sequences hold stays: they would be recomputed); the disk tier
    # keeps its blocks (warm restart). 0: no restart.
    restart_at_s: float = 0.0


# The shares `--honest` sets; no published figure gives them for Claude Code, so they are
# stated assumptions: 1 turn in 20 opens a new session (vLLM's agent study has a median
# of 43 turns a session), 1 in 30 follows a compaction (a context near the window is
# compacted every few dozen turns), 1 pause in 20 is two hours.
HONEST = {"new_session_share": 0.05, "compaction_share": 1 / 30, "long_idle_share": 0.05}


@dataclass
class AgentState:
    sessions: list[list[int]]  # each session's history; the agent works on one at a time
    ready_at: float
    current: int = 0
    session_turns: list[int] = field(default_factory=list)
    session_ids: list[int] = field(default_factory=list)  # bumped when a new one replaces it
    # The agent's own draws (breaks, switches, new sessions, compactions), so that what
    # happens to it does not hang on the order in which requests finish: wall clock and
    # virtual time then give every agent the same history, and the same prompt tokens.
    rng: random.Random = field(default_factory=random.Random)
    turn: int = 0
    request: str | None = None
    submitted_at: float = 0.0
    output: list[int] = field(default_factory=list)
    ttft: float | None = None


def run_scenario(core: EngineCore, sc: Scenario, clock, progress: tqdm | None = None) -> dict:
    """Drive agents against an engine; `clock()` is virtual (simulation) or wall time."""
    rng = random.Random(sc.seed)
    token_rng = np.random.default_rng(sc.seed)  # 45M random token ids: numpy, not a loop
    tok = lambda n: token_rng.integers(1, sc.vocab_size, n).tolist()  # noqa: E731
    shared = tok(sc.shared_tokens)
    agents = [AgentState([shared + tok(sc.context_tokens - sc.shared_tokens)
                          for _ in range(sc.sessions_per_agent)],
                         ready_at=rng.uniform(0, sc.active_wait_s),
                         session_turns=[0] * sc.sessions_per_agent,
                         session_ids=[0] * sc.sessions_per_agent,
                         rng=random.Random(f"{sc.seed}-{i}")) for i in range(sc.agents)]
    by_request: dict[str, AgentState] = {}
    ttfts, cpu_per_step = [], []
    # Counted two ways: every turn, and without the warm-up (`first` below).
    tally = {k: {"prompt": 0, "device": 0, "host": 0, "disk": 0, "read_s": 0.0}
             for k in ("all", "steady")}
    sched = core.scheduler
    restart_pending = sc.restart_at_s > 0
    while any(a.turn < sc.turns for a in agents):
        now = clock()
        if restart_pending and now >= sc.restart_at_s:
            restart_pending = False  # RAM is gone; the disk's index is found again
            sched.cache.device.drop_cached()
            sched.cache.host.drop_cached()
        for i, a in enumerate(agents):
            if a.request is None and a.turn < sc.turns and a.ready_at <= now:
                a.request, a.submitted_at, a.output, a.ttft = f"a{i}-t{a.turn}", now, [], None
                by_request[a.request] = a
                sched.add_request(GenerateRequest(
                    a.request, list(a.sessions[a.current]), sc.output_tokens, ignore_eos=True,
                    session_id=f"agent{i}-s{a.current}-{a.session_ids[a.current]}"))
        if not core.has_work():  # everyone is thinking: jump to the next arrival
            _advance(core, min(a.ready_at for a in agents if a.turn < sc.turns))
            continue
        t0 = time.process_time()
        outputs = core.step().outputs
        cpu_per_step.append(time.process_time() - t0)
        now = clock()
        for out in outputs:
            a = by_request[out.request_id]
            # the warm-up: the first turn of a session alive at the start (a brand-new
            # session's first turn is traffic a running deployment has, and counts)
            first = a.session_turns[a.current] == 0 and a.session_ids[a.current] == 0
            counted = not first or sc.count_first_turn
            if a.ttft is None and out.token_ids:
                a.ttft = now - a.submitted_at
                if counted:
                    ttfts.append(a.ttft)
            a.output += out.token_ids
            if out.finished:
                seq = sched.sequence(out.request_id)
                read_s = 0.0
                if isinstance(core.executor, CostModelExecutor) and seq is not None:
                    read_s = core.executor.prompt_seconds.pop(seq.seq_id, 0.0)
                for key in ("all",) if first else ("all", "steady"):
                    t = tally[key]
                    t["prompt"] += out.num_prompt_tokens
                    t["device"] += out.num_device_cached_tokens
                    t["host"] += out.num_host_cached_tokens
                    t["disk"] += out.num_disk_cached_tokens
                    t["read_s"] += read_s
                _next_turn(a, sc, tok, shared, now)
                if progress is not None:
                    progress.update(1)
    ttfts.sort()
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else 0.0  # noqa: E731
    ways = {k: {"prompt_tokens": t["prompt"],
                "hit_ratio": (t["device"] + t["host"] + t["disk"]) / max(1, t["prompt"]),
                "device_hit_ratio": t["device"] / max(1, t["prompt"]),
                "host_hit_ratio": t["host"] / max(1, t["prompt"]),
                "disk_hit_ratio": t["disk"] / max(1, t["prompt"]), "read_s": t["read_s"]}
            for k, t in tally.items()}
    return {
        **ways["all" if sc.count_first_turn else "steady"],
        "with_first_turns": ways["all"], "without_warmup": ways["steady"],
        "ttft_p50_s": pct(0.5), "ttft_p95_s": pct(0.95), "ttft_p99_s": pct(0.99),
        "steps": len(cpu_per_step),
        "scheduler_cpu_ms_per_step": 1000 * sum(cpu_per_step) / max(1, len(cpu_per_step)),
    }


def _next_turn(a: AgentState, sc: Scenario, tok, shared: list[int], now: float) -> None:
    """The agent's history grows by the answer and the next turn's tokens, then the
    scenario's events: a break (maybe switching session), a new session, a compaction."""
    a.sessions[a.current] = a.sessions[a.current] + a.output + tok(sc.turn_tokens)
    a.session_turns[a.current] += 1
    a.turn, a.request = a.turn + 1, None
    rng = a.rng
    idle = rng.random() < sc.idle_share
    if idle:  # back from a break, the developer may pick up another session
        a.current = rng.randrange(sc.sessions_per_agent)
    wait = sc.idle_wait_s if idle else sc.active_wait_s
    if sc.long_idle_share and rng.random() < sc.long_idle_share:
        wait = sc.long_idle_s
    if sc.new_session_share and rng.random() < sc.new_session_share:
        # a brand-new session takes the place of one of the agent's sessions
        a.current = rng.randrange(sc.sessions_per_agent)
        a.sessions[a.current] = shared + tok(sc.new_session_tokens)
        a.session_turns[a.current] = 0
        a.session_ids[a.current] += 1
    elif sc.compaction_share and rng.random() < sc.compaction_share:
        a.sessions[a.current] = shared + tok(sc.compacted_tokens)  # the prefix breaks here
    a.ready_at = now + rng.expovariate(1 / wait)


def _advance(core: EngineCore, until: float) -> None:
    executor = core.executor
    if isinstance(executor, CostModelExecutor):
        executor.clock = max(executor.clock, until)
    else:
        time.sleep(max(0.0, min(0.05, until - time.monotonic())))


def simulate(sc: Scenario, cost: CostModel | HardwareCostModel, device_tokens: int,
             host_tokens: int, policy: str, caching: bool, max_batched: int, desc: str,
             disk_tokens: int = 0) -> dict:
    block = 16
    executor = CostModelExecutor(cost, device_tokens // block, host_tokens // block,
                                 num_disk_blocks=disk_tokens // block)
    config = EngineConfig(model="simulated", block_size=block, kv_write_policy=policy,
                          enable_prefix_caching=caching, max_num_seqs=max(256, sc.agents),
                          max_num_batched_tokens=max_batched,
                          max_queued_requests=max(1024, sc.agents),
                          # a serial cost model: nothing to overlap, and a finished request
                          # stays readable (`sequence`) until its close
                          async_scheduling=False)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    core = EngineCore(Scheduler(config, agree_limits(executor.start()),
                                clock=lambda: executor.clock), executor)
    with tqdm(total=sc.agents * sc.turns, desc=desc, leave=False) as bar:
        result = run_scenario(core, sc, lambda: executor.clock, bar)
    # The deployment's "read rate": prompt tokens (cached ones count as read) per second
    # spent reading them: computing the missed tokens, plus every tier copy of the run
    # (charged in full to the counted turns; the disk's reads too, though they run beside
    # the steps). Decode time is left out: it is the same with the cache on or off.
    copies_s = executor.swap_seconds + executor.disk_read_seconds
    for r in (result, result["with_first_turns"], result["without_warmup"]):
        r["read_tokens_per_s"] = r["prompt_tokens"] / max(1e-12, r["read_s"] + copies_s)
    result["swap_s"] = executor.swap_seconds
    result["disk_read_s"] = executor.disk_read_seconds
    result["virtual_s"] = executor.clock
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["rss_growth_gib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sc, cost = Scenario(), CostModel()
    for name, value in {**asdict(sc), **asdict(cost)}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--honest", action="store_true",
                   help=f"new sessions, compactions and long idle gaps: {HONEST}")
    add_hardware_args(p)
    p.add_argument("--device-tokens", type=int, default=None,
                   help="override (default: from the presets, else the deployment's 57M)")
    p.add_argument("--host-tokens", type=int, default=None,
                   help="override (default: from the presets, else the deployment's 617M)")
    p.add_argument("--disk-tokens", type=int, default=0,
                   help="a disk tier below the host tier (0: none); with it, a run without "
                        "it follows for comparison")
    p.add_argument("--write-policy", default="write_back", choices=["write_back",
                                                                    "write_through"])
    p.add_argument("--max-num-batched-tokens", type=int, default=16_384)
    p.add_argument("--sweep", action="store_true",
                   help="host-tier size (0, 1/4, 1/2, 1x of --host-tokens) x write policy")
    p.add_argument("--compare-no-host", action="store_true",
                   help="also run the cache without its host tier")
    p.add_argument("--json", default=None)
    args = vars(p.parse_args(argv))
    if args["honest"]:
        args.update(HONEST)
    sc = Scenario(**{k: args[k] for k in asdict(sc)})
    console = Console(width=140)
    hw_cost, caps = hardware_cost(args)
    if hw_cost is not None:
        cost = hw_cost
        print_capacities(console, hw_cost, caps)
        if not caps.fits:
            console.print("the weights do not leave room for a device tier: nothing to run")
            return 1
    else:
        cost = CostModel(**{k: args[k] for k in asdict(cost)})
    device = args["device_tokens"] or (caps.device_tokens if caps else 57_000_000)
    host = args["host_tokens"] if args["host_tokens"] is not None else (
        caps.host_tokens if caps else 617_000_000)
    if args["no_host_tier"]:
        host = 0
    args["device_tokens"], args["host_tokens"] = device, host
    run = lambda host, policy, caching, desc: simulate(  # noqa: E731
        sc, cost, device, host, policy, caching, args["max_num_batched_tokens"], desc)
    results = {"cache on": run(host, args["write_policy"], True, "cache on")}
    if args["disk_tokens"]:
        results = {"cache on + disk": simulate(
            sc, cost, device, host, args["write_policy"], True, args["max_num_batched_tokens"],
            "cache on + disk", args["disk_tokens"]), **results}
    if args["compare_no_host"] and host:
        results["cache on, no host tier"] = run(0, args["write_policy"], True, "no host tier")
    results["cache off"] = run(host, args["write_policy"], False, "cache off")
    _report(console, sc, args, results)
    if args["sweep"]:
        sweep = {}
        for frac in (0.0, 0.25, 0.5, 1.0):
            for policy in ("write_back", "write_through"):
                h = int(host * frac)
                sweep[f"host {frac:g}x {policy}"] = run(h, policy, True, f"{frac}x {policy}")
        _sweep_table(console, sweep)
        results["sweep"] = sweep
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump({"args": args, "results": results}, f, indent=2)
    return 0


def _report(console: Console, sc: Scenario, args: dict, results: dict) -> None:
    on, off = results["cache on"], results["cache off"]
    table = Table(title=f"simulation: {sc.agents} agents, ~{sc.context_tokens:,}-token contexts, "
                        f"device {args['device_tokens']:,} / host {args['host_tokens']:,} / "
                        f"disk {args.get('disk_tokens', 0):,} tokens"
                        + (f", restart at {sc.restart_at_s:g} s" if sc.restart_at_s else ""))
    for col in ("run", "hit ratio", "device", "host", "disk", "read tok/s", "TTFT p50 s", "p95 s",
                "p99 s", "sched CPU ms/step", "steps", "peak RSS GiB"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{100 * r['hit_ratio']:.1f}%", f"{100 * r['device_hit_ratio']:.1f}%",
                      f"{100 * r['host_hit_ratio']:.1f}%", f"{100 * r['disk_hit_ratio']:.1f}%",
                      f"{r['read_tokens_per_s']:,.0f}", f"{r['ttft_p50_s']:.2f}",
                      f"{r['ttft_p95_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
                      f"{r['scheduler_cpu_ms_per_step']:.2f}", str(r["steps"]),
                      f"{r['peak_rss_gib']:.2f}")
    console.print(table)
    ratio = on["read_tokens_per_s"] / off["read_tokens_per_s"]
    console.print(f"hit ratio {100 * on['hit_ratio']:.1f}% (deployment "
                  f"{100 * DEPLOYMENT['hit_ratio']:.0f}%); read rate cache on/off {ratio:.1f}x "
                  f"(deployment {DEPLOYMENT['read_rate_ratio']:.0f}x)")
    for name, r in results.items():
        if name == "cache off":
            continue
        for way in ("with_first_turns", "without_warmup"):
            a, b = r[way], off[way]
            console.print(f"  {name}, {way.replace('_', ' ')}: hit ratio "
                          f"{100 * a['hit_ratio']:.1f}% (device {100 * a['device_hit_ratio']:.1f}%,"
                          f" host {100 * a['host_hit_ratio']:.1f}%, disk "
                          f"{100 * a['disk_hit_ratio']:.1f}%), read rate "
                          f"{a['read_tokens_per_s']:,.0f} vs {b['read_tokens_per_s']:,.0f} tok/s "
                          f"cache off: {a['read_tokens_per_s'] / b['read_tokens_per_s']:.1f}x")


def _sweep_table(console: Console, sweep: dict) -> None:
    table = Table(title="sweep: host-tier size x write policy (cache on)")
    for col in ("run", "hit ratio", "device", "host", "read tok/s", "TTFT p95 s"):
        table.add_column(col, justify="right")
    for name, r in sweep.items():
        table.add_row(name, f"{100 * r['hit_ratio']:.1f}%", f"{100 * r['device_hit_ratio']:.1f}%",
                      f"{100 * r['host_hit_ratio']:.1f}%", f"{r['read_tokens_per_s']:,.0f}",
                      f"{r['ttft_p95_s']:.2f}")
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
