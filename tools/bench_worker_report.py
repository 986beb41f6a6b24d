"""What tools/bench_worker.py prints and records besides its measurements: the
all-reduce share estimate, the machine, and the results table."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.bench_worker import BenchArgs


def add_shares(run: dict, args: BenchArgs) -> None:
    """Estimate the share of a step spent in all-reduces (measured alone, not in the step)."""
    ar, n = run["all_reduce_us"], run["all_reduces_per_forward"]
    if not ar:
        run["all_reduce_share"] = {}
        return
    step_us = {"prefill": args.prompt_len / run["prefill_tok_s"]["one_chunk"] * 1e6}
    cost_us = {"prefill": n * ar[str(args.prompt_len)]}
    for b in args.batch_sizes:
        step_us[f"decode_b{b}"] = b / run["decode_tok_s"][str(b)] * 1e6
        cost_us[f"decode_b{b}"] = n * ar[str(b)]
    run["all_reduce_share"] = {k: cost_us[k] / step_us[k] for k in step_us}


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__,
            "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def print_table(runs: list[dict], args: BenchArgs) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = lambda x: f"{x:,.0f}"  # noqa: E731
    table = Table(title=f"Worker ranks ({args.device}, {args.dtype}): {args.prompt_len}-token "
                        f"prefill, {args.decode_steps} decode steps")
    table.add_column("world size", justify="right")
    table.add_column("threads/rank", justify="right")
    table.add_column("prefill tok/s (one chunk)", justify="right")
    table.add_column(f"prefill tok/s ({args.chunk} chunks)", justify="right")
    table.add_column("prefill TFLOP/s", justify="right")
    for b in args.batch_sizes:
        table.add_column(f"decode tok/s b={b}", justify="right")
    for b in args.batch_sizes if args.shared_prefix_len else ():
        table.add_column(f"b={b} after {args.shared_prefix_len} shared", justify="right")
    table.add_column("all-reduce µs [1, hidden]", justify="right")
    table.add_column(f"all-reduce µs [{args.prompt_len}, hidden]", justify="right")
    for run in runs:
        ar = run["all_reduce_us"]
        table.add_row(
            str(run["world_size"]), str(run["threads_per_rank"]),
            fmt(run["prefill_tok_s"]["one_chunk"]), fmt(run["prefill_tok_s"]["chunked"]),
            f"{run['prefill_tflop_s']['one_chunk']:,.2f}",
            *(fmt(run["decode_tok_s"][str(b)]) for b in args.batch_sizes),
            *(fmt(run["decode_prefix_tok_s"][str(b)]) for b in args.batch_sizes
              if args.shared_prefix_len),
            f"{ar['1']:,.1f}" if ar else "N/A",
            fmt(ar[str(args.prompt_len)]) if ar else "N/A",
        )
    # Wide enough for every column even when stdout is a pipe (rich assumes 80 there).
    console = Console(width=max(150, Console().width))
    console.print(table)
    for run in runs:
        if "other_load_cores" in run:
            console.print(f"world size {run['world_size']}: other processes kept "
                          f"{run['other_load_cores']:.2f} cores busy meanwhile")
        if run["all_reduce_share"]:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in run["all_reduce_share"].items())
            console.print(f"world size {run['world_size']}: all-reduce share of a step "
                          f"(est., {run['all_reduces_per_forward']} per forward): {shares}")
