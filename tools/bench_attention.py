"""Prefill attention on CPU: the compiled paged kernel against torch's fused SDPA path.

    python -m tools.bench_attention [--dtypes float32,bfloat16] [--repeats 7]

Both run the torch backend (worker/attention/torch_backend.py) on the same random pages,
scattered over the pool as the engine's are: once with the compiled CPU kernels
(`paged_prefill`), once with DEEPINFER_CPU_KERNELS=0 semantics (pages gathered, SDPA's
flash kernel; behind a prefix two calls merged by log-sum-exp). The shapes are the
coding-agent load's: a tool result of 216 tokens behind ~2,800 cached ones (tiny model's
8 / 4 heads and SmolLM2's 9 / 3, head dim 64), four such chunks in one step, and a cold
2,000-token prompt. Printed: ms and achieved GFLOP/s (QK and PV, causal), the kernel's
speed-up, and the machine (CPU, flags, threads, measured matmul and copy rates) beside
them. The fastest of `--repeats` runs counts: other load only ever slows a run.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from rich.console import Console
from rich.table import Table

from tools.machine import describe, summary_line
from worker import cpu_kernels
from worker.attention import AttentionMetadata
from worker.attention.torch_backend import TorchAttentionBackend

PAGE = 16
# (label, query heads, KV heads, head dim, [(query tokens, context tokens) per sequence])
CASES = [
    ("tiny: 216 behind 2,800", 8, 4, 64, [(216, 3016)]),
    ("SmolLM2: 216 behind 2,800", 9, 3, 64, [(216, 3016)]),
    ("tiny: 4 x 216 behind 2,800", 8, 4, 64, [(216, 3016)] * 4),
    ("tiny: 2,000 cold", 8, 4, 64, [(2000, 2000)]),
]


def make_step(lens: list[tuple[int, int]], heads: int, kv_heads: int, d: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           AttentionMetadata]:
    """Random q and KV pages for one step, each sequence's pages scattered."""
    g = torch.Generator().manual_seed(0)
    num_pages = sum(-(-kv // PAGE) for _, kv in lens) + 8
    k = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    qo, kvp, idx, last = [0], [0], [], []
    for q_len, kv_len in lens:
        n = -(-kv_len // PAGE)
        idx += perm[:n]
        perm = perm[n:]
        qo.append(qo[-1] + q_len)
        kvp.append(len(idx))
        last.append(kv_len - (n - 1) * PAGE)
    q = torch.randn(qo[-1], heads, d, generator=g).to(dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return q, k, v, AttentionMetadata(i32(qo), i32(kvp), i32(idx), i32(last), PAGE)


def flop(lens: list[tuple[int, int]], heads: int, d: int) -> float:
    """QK and PV over the keys each query sees (causal, behind its prefix)."""
    return sum(4 * heads * d * (q * (kv - q) + q * (q + 1) / 2) for q, kv in lens)


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None, console: Console | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels are not built (make cpu-kernels)")
    console = console or Console()
    console.print(summary_line(describe()))
    table = Table(title="Prefill attention, one layer: compiled kernel vs gathered SDPA")
    for col in ("dtype", "case", "kernel ms", "kernel GFLOP/s", "SDPA ms", "SDPA GFLOP/s",
                "speed-up"):
        table.add_column(col, justify="left" if col in ("dtype", "case") else "right")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for label, heads, kv_heads, d, lens in CASES:
            q, k, v, meta = make_step(lens, heads, kv_heads, d, dtype)
            seconds = []
            for module in (kernels, None):
                backend = TorchAttentionBackend(heads, kv_heads, d, kernels=module)
                backend.plan(meta)
                run = functools.partial(backend.forward, q, k, v)
                seconds.append(best_seconds(run, args.repeats))
            f = flop(lens, heads, d) / 1e9
            table.add_row(name, label, f"{1000 * seconds[0]:.2f}", f"{f / seconds[0]:,.0f}",
                          f"{1000 * seconds[1]:.2f}", f"{f / seconds[1]:,.0f}",
                          f"{seconds[1] / seconds[0]:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
