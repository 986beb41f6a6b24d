"""What tools/benchmarks/worker.py is asked and what it prints and records besides its
measurements: its parameters, the all-reduce share estimate, the machine, and the
results table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

BLOCK_SIZE = 16  # EngineConfig's default, which the ranks use


@dataclass(frozen=True)
class BenchArgs:
    """What every rank measures; handed to the ranks as JSON on the command line."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    prompt_len: int = 2000
    chunk: int = 512
    decode_prompt_len: int = 128
    decode_steps: int = 32
    batch_sizes: tuple[int, ...] = (1, 16)
    shared_prefix_len: int = 0  # > 0: decode again behind this many shared cached tokens
    repeats: int = 3  # timed runs of each part; the fastest is reported
    warmup_steps: int = 4  # decode steps before the timed ones
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.chunk, self.decode_prompt_len, self.decode_steps) < 1:
            raise ValueError("lengths and step counts must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.repeats < 1 or self.warmup_steps < 0:
            raise ValueError("repeats must be >= 1 and warmup_steps >= 0")
        if self.shared_prefix_len < 0 or self.shared_prefix_len % BLOCK_SIZE:
            # a partly filled last prefix block would be written by every sequence
            raise ValueError(f"shared_prefix_len must be a multiple of {BLOCK_SIZE}")

    def to_json(self) -> str:
        """For a child's command line (`--rank-args`, `--hf-args`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchArgs:
        raw = json.loads(text)
        return cls(**dict(raw, batch_sizes=tuple(raw["batch_sizes"])))

    @property
    def decode_len(self) -> int:
        return self.decode_prompt_len + self.warmup_steps + self.repeats * self.decode_steps


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
