"""Retention against plain LRU, in virtual time: agents whose sessions pause for minutes
while a burst of one-off long requests passes through.

    python -m tools.sim.retention [--agents 8] [--session-tokens 20000] [--json OUT]

The real scheduler and cache (cache/retention.py) with the simulator's cost-model ranks
(tools/simulate.py). Each round, every agent runs one turn of its session (its whole
history, marked for retention as Claude Code marks it: `cache_control` with a 5-minute
TTL), then pauses for `pause_s` (shorter than the TTL: a user reading, a long tool run).
During the pause a burst of unmarked one-off requests, together larger than both tiers,
passes through. The figure is the hit ratio of the agents' returning turns: under plain
LRU the burst has evicted their sessions; with retention they are still there, as long as
they fit under the cap. The same load runs both ways, one after the other.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from scheduler.engine import EngineCore, agree_limits
from scheduler.scheduler import Scheduler
from tools.sim.executor import CostModel, CostModelExecutor
from wire.client import GenerateRequest, Retention
from wire.config import EngineConfig

BLOCK = 16


@dataclass
class RetentionScenario:
    agents: int = 8
    session_tokens: int = 20_000  # each agent's history at the start
    turn_tokens: int = 1_000  # new tokens per returning turn
    output_tokens: int = 50
    rounds: int = 4
    pause_s: float = 180.0  # between an agent's turns (under the 5-minute TTL)
    burst_requests: int = 24  # one-offs during each pause
    burst_tokens: int = 16_000  # each
    ttl_s: float = 300.0
    device_tokens: int = 120_000
    host_tokens: int = 240_000
    max_retained_fraction: float = 0.5
    seed: int = 0


def _drain(core: EngineCore, bar: tqdm | None = None) -> dict[str, tuple[int, int]]:
    """Step until every request is done; (prompt tokens, cached tokens) per request."""
    done: dict[str, tuple[int, int]] = {}
    while core.has_work():
        for out in core.step().outputs:
            if out.finished:
                done[out.request_id] = (out.num_prompt_tokens, out.num_device_cached_tokens
                                        + out.num_host_cached_tokens)
                if bar is not None:
                    bar.update(1)
    return done


def run(sc: RetentionScenario, retain: bool, desc: str) -> dict:
    cost = CostModel()
    executor = CostModelExecutor(cost, sc.device_tokens // BLOCK, sc.host_tokens // BLOCK,
                                 vocab_size=256)
    config = EngineConfig(model="simulated", block_size=BLOCK,
                          max_retained_fraction=sc.max_retained_fraction,
                          max_num_seqs=256, max_num_batched_tokens=16_384)
    core = EngineCore(Scheduler(config, agree_limits(executor.start()),
                                clock=lambda: executor.clock), executor)
    sched = core.scheduler
    rng = np.random.default_rng(sc.seed)
    tok = lambda n: rng.integers(1, 256, n).tolist()  # noqa: E731
    sessions = [tok(sc.session_tokens) for _ in range(sc.agents)]
    returning_prompt = returning_cached = 0
    total = sc.rounds * (sc.agents + sc.burst_requests)
    with tqdm(total=total, desc=desc, leave=False) as bar:
        for r in range(sc.rounds):
            round_start = executor.clock
            for i, history in enumerate(sessions):
                marks = [Retention(len(history), sc.ttl_s)] if retain else []
                sched.add_request(GenerateRequest(f"a{i}-r{r}", list(history),
                                                  sc.output_tokens, ignore_eos=True,
                                                  session_id=f"agent{i}", retention=marks))
            done = _drain(core, bar)
            if r > 0:  # the agents came back after a pause: did their sessions survive?
                for i in range(sc.agents):
                    prompt, cached = done[f"a{i}-r{r}"]
                    returning_prompt += prompt
                    returning_cached += cached
            for i in range(sc.agents):  # the answer and the next tool result
                sessions[i] = sessions[i] + [1000 % 256] * sc.output_tokens + tok(sc.turn_tokens)
            for b in range(sc.burst_requests):  # one-offs while the agents are away
                sched.add_request(GenerateRequest(f"burst-r{r}-{b}", tok(sc.burst_tokens),
                                                  1, ignore_eos=True))
            _drain(core, bar)
            executor.clock = max(executor.clock, round_start + sc.pause_s)
    stats = sched.cache.stats
    return {
        "returning_hit_ratio": returning_cached / returning_prompt,
        "returning_prompt_tokens": returning_prompt,
        "device_retained_evictions": stats.num_device_retained_evictions,
        "host_retained_evictions": stats.num_host_retained_evictions,
        "device_evictions": stats.num_device_evictions,
        "host_evictions": stats.num_host_evictions,
        "virtual_s": executor.clock,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(RetentionScenario()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--json", default=None)
    args = vars(p.parse_args(argv))
    json_path = args.pop("json")
    sc = RetentionScenario(**args)
    results = {"plain LRU": run(sc, False, "plain LRU"),
               "retention": run(sc, True, "retention")}
    table = Table(title=f"retention: {sc.agents} agents x {sc.session_tokens:,}-token sessions, "
                        f"{sc.pause_s:g} s pauses, bursts of {sc.burst_requests} x "
                        f"{sc.burst_tokens:,} tokens; device {sc.device_tokens:,} / host "
                        f"{sc.host_tokens:,} tokens, cap {sc.max_retained_fraction:g}")
    for col in ("policy", "returning hit ratio", "retained evicted early (device / host)",
                "evictions (device / host)"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{100 * r['returning_hit_ratio']:.1f}%",
                      f"{r['device_retained_evictions']} / {r['host_retained_evictions']}",
                      f"{r['device_evictions']:,} / {r['host_evictions']:,}")
    Console(width=140).print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"scenario": asdict(sc), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
