"""Mixture-of-experts benchmark: prefill and decode tokens/s of an MoE model at each world
size, and the share of the forward spent routing and in the experts' matmuls.

    python -m tools.benchmarks.moe --model models/tiny-qwen3-moe --world-sizes 1,4

The ranks are tools/benchmarks/worker.py's (`RankBench`: the same hand-made plans on every
rank, gloo, cores / ranks threads, the fastest of `--repeats` runs). After the timed
runs each rank profiles one prefill and the decode steps again under torch.profiler:
`moe_routing` (router matmul, softmax, top-k, grouping the tokens by expert) and
`moe_experts` (the per-expert gate/up/down matmuls and the scatter-add) are
record_function ranges in worker/moe.py, summed against the model's whole forward.
Figures are printed, not asserted; say the load average beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tools.benchmarks.machine import describe, summary_line
from tools.benchmarks.worker import MARKER, RankBench, run_world
from tools.benchmarks.worker_report import BenchArgs

RANGES = ("moe_routing", "moe_experts")


def _profiled_forward(bench: RankBench) -> None:
    """Wrap the model's forward in a `model_forward` range (the denominator of the shares)."""
    from torch.profiler import record_function

    model = bench.runner.model
    forward = model.forward

    def timed_forward(*args, **kwargs):
        with record_function("model_forward"):
            return forward(*args, **kwargs)

    model.forward = timed_forward


def _shares(prof) -> dict[str, float]:
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    whole = totals.get("model_forward", 0.0)
    return {name: (totals.get(name, 0.0) / whole if whole else 0.0) for name in RANGES}


def rank_result(args: BenchArgs) -> tuple[RankBench, dict]:
    from torch.profiler import ProfilerActivity, profile

    bench = RankBench(args)
    bench.prefill_s(args.prompt_len)  # warm-up
    prefill = args.prompt_len / min(bench.prefill_s(args.prompt_len) for _ in range(args.repeats))
    decode = {str(b): b * args.decode_steps / min(bench.decode_s(b)) for b in args.batch_sizes}
    _profiled_forward(bench)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench.prefill_s(args.prompt_len)
    prefill_share = _shares(prof)
    decode_share = {}
    for b in args.batch_sizes:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.decode_s(b)
        decode_share[str(b)] = _shares(prof)
    mc = bench.runner.model_config
    return bench, {
        "world_size": bench.tp.world_size,
        "threads_per_rank": bench.threads,
        "dtype": str(bench.runner.dtype).removeprefix("torch."),
        "experts": mc.num_experts, "top_k": mc.num_experts_per_tok,
        "moe_layers": len(mc.moe_layers), "num_layers": mc.num_layers,
        "prefill_tok_s": prefill, "decode_tok_s": decode,
        "prefill_share": prefill_share, "decode_share": decode_share,
    }


def rank_main(args: BenchArgs) -> None:
    bench, result = rank_result(args)
    if bench.tp.rank == 0:
        print(MARKER + json.dumps(result), flush=True)
    if bench.tp.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def print_table(runs: list[dict]) -> None:
    def pct(share: dict) -> str:
        return f"{100 * share['moe_routing']:4.1f}% / {100 * share['moe_experts']:4.1f}%"

    print(f"{'ranks':>5} {'prefill tok/s':>14} {'routing / experts':>18}   decode tok/s "
          "(batch: tok/s, routing / experts)")
    for r in runs:
        decode = "; ".join(f"{b}: {v:,.0f}, {pct(r['decode_share'][b])}"
                           for b, v in r["decode_tok_s"].items())
        print(f"{r['world_size']:>5} {r['prefill_tok_s']:>14,.0f} "
              f"{pct(r['prefill_share']):>18}   {decode}")


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m tools.benchmarks.moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-qwen3-moe")
    ap.add_argument("--world-sizes", type=ints, default=(1, 4))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--batch-sizes", type=ints, default=(1, 16))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--rank-args", help=argparse.SUPPRESS)  # internal: run as one rank
    ns = ap.parse_args(argv)
    if ns.rank_args:
        rank_main(BenchArgs.from_json(ns.rank_args))
        return
    args = BenchArgs(model=str(Path(ns.model).resolve()), dtype=ns.dtype,
                     prompt_len=ns.prompt_len, chunk=ns.prompt_len, decode_prompt_len=32,
                     decode_steps=ns.decode_steps, batch_sizes=ns.batch_sizes,
                     repeats=ns.repeats)
    machine = describe()
    print(summary_line(machine))
    print(f"model {ns.model}, {args.dtype}, prompt {args.prompt_len} tokens in one chunk, "
          f"decode {args.decode_steps} steps after a {args.decode_prompt_len}-token prompt")
    runs = [run_world(args, w, ns.timeout, module="tools.benchmarks.moe") for w in ns.world_sizes]
    print_table(runs)
    print(summary_line(describe(measure=False)))  # the load average after, too
    if ns.json:
        ns.json.write_text(json.dumps({"machine": machine, "args": dataclasses.asdict(args),
                                       "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
