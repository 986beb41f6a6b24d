"""Attention on CPU: the compiled paged kernels against torch's fused SDPA path.

    python -m tools.benchmarks.attention [--dtypes float32,bfloat16] [--repeats 7] [--max-layers N]

Both run the torch backend (worker/attention/torch_backend.py) on the same random pages,
scattered over the pool as the engine's are: once with the compiled CPU kernels
(`paged_prefill`), once with DEEPINFER_CPU_KERNELS=0 semantics (pages gathered, SDPA's
flash kernel; behind a prefix two calls merged by log-sum-exp). The shapes are the
coding-agent load's: a tool result of 216 tokens behind ~2,800 cached ones (tiny model's
8 / 4 heads and SmolLM2's 9 / 3, head dim 64), four such chunks in one step, and a cold
2,000-token prompt. Printed: ms and achieved GFLOP/s (QK and PV, causal), the kernel's
speed-up, and the machine (CPU, flags, threads, measured matmul and copy rates) beside
them.

Decode (`paged_decode` against the gathered, padded SDPA call) is memory-bound, so its
cases run a whole step: every layer of the model with its own KV pool (the tiny model's
8, SmolLM2's 30; fewer with `--max-layers`), so the context comes from memory and not
from a cache that one layer's pages would fit in. The agent load's decode (4 sequences
of 3,000 tokens), a speculative verify (1 + 4 query rows) and a wide batch. Printed: ms
per step and the KV read rate in GB/s (each sequence's whole context counted: on a shared
prefix the kernel reads fewer bytes than that), beside a copy rate measured just before the
case: on a shared machine the memory's rate moves by half from one minute to the next, so
the share of copy compares figures of one moment. The fastest of `--repeats` runs counts: other
load only ever slows a run.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from rich.console import Console
from rich.table import Table

from tools.benchmarks.machine import copy_gb_s, describe, print_summary
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
    # a long agent history: a turn's tool result behind a 12K-token cached prefix
    ("tiny: 1,000 behind 12,000", 8, 4, 64, [(1000, 13000)]),
    ("SmolLM2: 1,000 behind 12,000", 9, 3, 64, [(1000, 13000)]),
]

# (label, query heads, KV heads, head dim, layers, [(query rows, context) per sequence],
# context tokens every sequence shares with the first: the same pages)
DECODE_CASES = [
    ("tiny: 4 x 3,000", 8, 4, 64, 8, [(1, 3000)] * 4, 0),
    ("tiny: 4 x 3,000 on a shared 2,000", 8, 4, 64, 8, [(1, 3000)] * 4, 2000),
    ("SmolLM2: 4 x 3,000", 9, 3, 64, 30, [(1, 3000)] * 4, 0),
    ("SmolLM2: 4 x 3,000 on a shared 2,000", 9, 3, 64, 30, [(1, 3000)] * 4, 2000),
    ("SmolLM2: verify 1 + 4 behind 3,000", 9, 3, 64, 30, [(5, 3000)], 0),
    ("tiny: 64 x 500", 8, 4, 64, 8, [(1, 500)] * 64, 0),
    ("tiny: 4 x 12,000", 8, 4, 64, 8, [(1, 12000)] * 4, 0),
]


def make_step(lens: list[tuple[int, int]], heads: int, kv_heads: int, d: int,
              dtype: torch.dtype, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, AttentionMetadata]:
    """Random q and KV pages for one step, each sequence's pages scattered; every
    sequence's first `shared` tokens (whole pages) on the first sequence's pages, as
    the prefix cache gives agents with one system prompt."""
    g = torch.Generator().manual_seed(0)
    num_pages = sum(-(-kv // PAGE) for _, kv in lens) + 8
    k = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    qo, kvp, idx, last = [0], [0], [], []
    assert all(kv >= shared for _, kv in lens), "a sequence shorter than the shared prefix"
    common: list[int] = []
    for q_len, kv_len in lens:
        n = -(-kv_len // PAGE)
        own = perm[: n - len(common)]
        perm = perm[n - len(common):]
        idx += common + own
        if not common and shared:
            common = own[: shared // PAGE]
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


def kv_bytes(lens: list[tuple[int, int]], kv_heads: int, d: int, dtype: torch.dtype) -> int:
    """K and V of every sequence's context, one layer."""
    return 2 * sum(kv for _, kv in lens) * kv_heads * d * dtype.itemsize


def decode_table(kernels, dtypes: list[torch.dtype], repeats: int, max_layers: int) -> Table:
    table = Table(title="Decode attention, one step (every layer): paged_decode vs gathered "
                        "SDPA; 'of copy': the kernel's read rate / the copy rate measured just "
                        "before it (the machine's memory rate moves from minute to minute)")
    for col in ("dtype", "case", "layers", "kernel ms", "kernel GB/s", "copy GB/s", "of copy",
                "SDPA ms", "SDPA GB/s", "speed-up"):
        table.add_column(col, justify="left" if col in ("dtype", "case") else "right")
    for dtype in dtypes:
        for label, heads, kv_heads, d, layers, lens, shared in DECODE_CASES:
            layers = min(layers, max_layers)
            steps = [make_step(lens, heads, kv_heads, d, dtype, shared) for _ in range(layers)]
            seconds = []
            copy_rate = copy_gb_s(repeats=min(3, repeats))
            for module in (kernels, None):
                backend = TorchAttentionBackend(heads, kv_heads, d, kernels=module)
                backend.plan(steps[0][3])  # every layer shares the step's page table

                def step(backend=backend, steps=steps) -> None:
                    for q, k, v, _ in steps:
                        backend.forward(q, k, v)

                seconds.append(best_seconds(step, repeats))
            gb = layers * kv_bytes(lens, kv_heads, d, dtype) / 1e9
            table.add_row(str(dtype).removeprefix("torch."), label, str(layers),
                          f"{1000 * seconds[0]:.2f}", f"{gb / seconds[0]:.1f}",
                          f"{copy_rate:.1f}", f"{gb / seconds[0] / copy_rate:.0%}",
                          f"{1000 * seconds[1]:.2f}", f"{gb / seconds[1]:.1f}",
                          f"{seconds[1] / seconds[0]:.2f}x")
            del steps
    return table


def main(argv: list[str] | None = None, console: Console | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-layers", type=int, default=64,
                    help="at most this many layers per decode step (default: the model's)")
    args = ap.parse_args(argv)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels are not built (make cpu-kernels)")
    console = console or Console(width=160)
    machine = describe()
    print_summary(console, machine)
    roof = machine["matmul_gflop_s"]
    table = Table(title="Prefill attention, one layer: compiled kernel vs gathered SDPA; 'of "
                        "matmul': the kernel's rate / the measured matmul rate of its dtype "
                        f"({', '.join(f'{k} {v:,.0f}' for k, v in roof.items())} GFLOP/s)")
    for col in ("dtype", "case", "kernel ms", "kernel GFLOP/s", "of matmul", "SDPA ms",
                "SDPA GFLOP/s", "speed-up"):
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
                          f"{f / seconds[0] / roof[name]:.0%}",
                          f"{1000 * seconds[1]:.2f}", f"{f / seconds[1]:,.0f}",
                          f"{seconds[1] / seconds[0]:.2f}x")
    console.print(table)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    console.print(decode_table(kernels, dtypes, args.repeats, args.max_layers))
    print_summary(console, machine)


if __name__ == "__main__":
    main()
