"""Engine benchmark: the real scheduler driving real ranks over ZeroMQ, no HTTP.

    python -m tools.benchmarks.engine --model models/tiny-llama [--world-sizes 1,4]
        [--num-requests 32] [--prompt-len 256] [--max-tokens 32] [--guided] [--json OUT]

Per world size: requests/s and tokens/s for a batch of concurrent requests, and
the share of step time spent outside rank 0's forward pass (planning, msgpack
encoding, IPC and waiting for the slowest rank, applying results). With --guided,
each world size runs a second time with every request under a grammar (structured
outputs: a JSON array of short lowercase strings), for the cost of the token masks.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from orchestrator.launcher import stop_all
from orchestrator.shim.structured_output import json_grammar
from scheduler.engine import EngineCore, StepTotals, agree_limits
from scheduler.executor import ZmqExecutor
from scheduler.scheduler import Scheduler
from tools.harness.local_ranks import spawn_local_ranks
from wire import codec
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.gc_policy import settle_heap
from wire.step import NewSequence, ScheduledChunk, StepPlan

# too long to close within max_tokens: a guided request runs as long as a free one
GUIDED_SCHEMA = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                 "minItems": 1000}


def run_one(model: str, world_size: int, args: argparse.Namespace,
            guided: bool = False) -> dict:
    config = EngineConfig(model=model, world_size=world_size, dtype="float32",
                          kv_cache_memory=256 << 20, max_num_seqs=args.num_requests,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=False)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as run_dir:
        address = f"ipc://{run_dir}/workers.sock"
        executor = ZmqExecutor(address, config)
        ranks = spawn_local_ranks(address, world_size)
        try:
            core = EngineCore(Scheduler(config, agree_limits(executor.start())), executor)
            settle_heap()  # as the scheduler process does before it serves
            rng = random.Random(0)
            grammar = json_grammar(GUIDED_SCHEMA, "bench") if guided else None
            make = lambda tag: [  # noqa: E731
                GenerateRequest(f"{tag}{i}", [rng.randrange(10, 8000)
                                              for _ in range(args.prompt_len)],
                                args.max_tokens, ignore_eos=True, grammar=grammar)
                for i in range(args.num_requests)]
            _drive(core, make("warm")[:2])  # warm-up: first-step allocations, thread pools
            core.totals = StepTotals(overlap=core.overlap)
            start = time.perf_counter()
            steps, tokens_out = _drive(core, make("r"))
            wall = time.perf_counter() - start
            encode_s = _encode_cost(core)  # msgpack cost of a plan, apart from IPC
        finally:
            executor.shutdown()
            stop_all(ranks)
    t = core.totals
    step_total = t.schedule_s + t.execute_s + t.update_s
    outside = step_total - t.forward_s
    return {
        "world_size": world_size,
        "guided": guided,
        "requests_per_s": args.num_requests / wall,
        "output_tokens_per_s": tokens_out / wall,
        "total_tokens_per_s": (tokens_out + args.num_requests * args.prompt_len) / wall,
        "steps": steps,
        "outside_forward_share": outside / step_total,
        "schedule_ms_per_step": 1000 * t.schedule_s / steps,
        "ipc_and_wait_ms_per_step": 1000 * (t.execute_s - t.forward_s) / steps,
        "update_ms_per_step": 1000 * t.update_s / steps,
        "forward_ms_per_step": 1000 * t.forward_s / steps,
        "encode_decode_ms_per_plan": 1000 * encode_s,
    }


def _drive(core: EngineCore, requests: list[GenerateRequest]) -> tuple[int, int]:
    """(steps, output tokens) to run `requests` to the end."""
    for r in requests:
        core.scheduler.add_request(r)
    steps = tokens = 0
    while core.has_work():
        tokens += sum(len(out.token_ids) for out in core.step().outputs)
        steps += 1
    return steps, tokens


def _encode_cost(core: EngineCore, repeats: int = 200) -> float:
    """Encode + decode a decode-step plan of max batch size, averaged."""
    n = core.scheduler.config.max_num_seqs
    plan = StepPlan(step=1, new_seqs=[NewSequence(i, list(range(20))) for i in range(4)],
                    chunks=[ScheduledChunk(i, [5], 300, True) for i in range(n)])
    t0 = time.perf_counter()
    for _ in range(repeats):
        codec.decode(codec.encode(plan))
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--world-sizes", default="1,4")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--guided", action="store_true",
                   help="also run every world size with each request under a grammar")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = [(int(x), guided) for x in args.world_sizes.split(",")
            for guided in ((False, True) if args.guided else (False,))]
    rows = [run_one(args.model, ws, args, guided) for ws, guided in tqdm(runs, desc="runs")]

    table = Table(title=f"engine: {args.num_requests} concurrent requests, "
                        f"{args.prompt_len}-token prompts, {args.max_tokens} output tokens")
    for col in ("world size", "guided", "req/s", "out tok/s", "total tok/s", "steps", "outside fwd",
                "schedule ms", "IPC+wait ms", "update ms", "forward ms", "codec ms/plan"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["world_size"]), "yes" if r["guided"] else "no",
                      f"{r['requests_per_s']:.2f}",
                      f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.0f}",
                      str(r["steps"]), f"{100 * r['outside_forward_share']:.1f}%",
                      f"{r['schedule_ms_per_step']:.2f}", f"{r['ipc_and_wait_ms_per_step']:.2f}",
                      f"{r['update_ms_per_step']:.2f}", f"{r['forward_ms_per_step']:.1f}",
                      f"{r['encode_decode_ms_per_plan']:.3f}")
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
