"""What KV events cost the scheduler's step: the same agent load planned with the event
recorder and publisher off and on (no ranks: every sample is token 7).

    python -m tools.benchmarks.kv_events [--agents 16] [--turns 6] [--repeats 3]

16 agents of 4,000-token histories growing 532 tokens a turn over a 2,048-block device
tier and a 16,384-slot host tier: tens of thousands of evictions and thousands of copies
to the host, each one an event. Prints schedule() (+ take_events and publish) per step.
"""

from __future__ import annotations

import argparse
import random
import time

from scheduler.kv_events import KVEventPublisher
from scheduler.scheduler import Scheduler
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.lifecycle import EngineLimits


def run(events: bool, agents: int, turns: int) -> dict:
    config = EngineConfig(model="/m", block_size=16, max_num_batched_tokens=8192,
                          kv_events_endpoint="tcp://127.0.0.1:*" if events else "")
    sched = Scheduler(config, EngineLimits(vocab_size=32000, max_model_len=65536,
                                           eos_token_ids=(3,), num_device_blocks=2048,
                                           num_host_blocks=16384))
    pub = KVEventPublisher(config.kv_events_endpoint, "m") if events else None
    rng = random.Random(0)
    histories = [[rng.randrange(10, 32000) for _ in range(4000)] for _ in range(agents)]
    plan_s, steps = 0.0, 0
    for turn in range(turns):
        for a, h in enumerate(histories):
            sched.add_request(GenerateRequest(f"{a}-{turn}", list(h), 32))
        while sched.has_work():
            t = time.perf_counter()
            plan = sched.schedule()
            if pub is not None:
                pub.publish(sched.cache.take_events())
            plan_s += time.perf_counter() - t
            steps += 1
            sched.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
        for h in histories:
            h += [7] * 32 + [rng.randrange(10, 32000) for _ in range(500)]
    batches = pub.num_published if pub is not None else 0
    if pub is not None:
        pub.close()
    stats = sched.cache.stats
    return {"steps": steps, "ms_per_step": 1000 * plan_s / steps, "batches": batches,
            "evictions": stats.num_device_evictions, "swap_out": stats.num_swap_out_blocks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    best: dict[bool, dict] = {}
    for _ in range(args.repeats):
        for events in (False, True):
            r = run(events, args.agents, args.turns)
            if events not in best or r["ms_per_step"] < best[events]["ms_per_step"]:
                best[events] = r
    for events, r in best.items():
        print(f"events {'on ' if events else 'off'}: {r['steps']} steps, "
              f"{r['ms_per_step']:.3f} ms/step planning (best of {args.repeats}), "
              f"{r['evictions']} evictions, {r['swap_out']} copies to host, "
              f"{r['batches']} event batches")
    off, on = best[False]["ms_per_step"], best[True]["ms_per_step"]
    print(f"events cost {1000 * (on - off):.0f} us a step ({on / off - 1:+.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
