"""The chunked gated delta rule on the CPU (worker/gated_delta.py), against the matmul rate.

    python -m tools.benchmarks.delta_rule [--repeats 5] [--max-tokens N] [--threads N]

A hybrid model's prefill (Qwen3.5, Qwen3-Next) runs every Gated DeltaNet layer's heads
through `chunked_delta_rule`, 64 tokens a block. The cases are one layer of the tiny
model (8 value heads of 32) and of Qwen3-Next per rank (16 value heads of 128, 2K and 8K
tokens), each also in the pieces the engine cuts a chunk into at its state snapshots
(every `--state-snapshot-interval` K blocks of 16 tokens: pieces of 16 K tokens, each
ending on a partial 64-token block). Printed: ms, tokens/s, GFLOP/s of the algorithm as
implemented (`flop`) and its share of the float32 matmul rate measured on the spot, with
the machine (CPU, flags, threads, rates, load average) before and after. The fastest of
`--repeats` runs counts: other load only ever slows a run. On a machine busier than its
cores, `--threads 1`: torch's threads then wait on one another for every small product.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from tools.benchmarks.machine import describe, print_summary
from worker.gated_delta import chunked_delta_rule, normalize_qk

BLOCK = 64  # chunked_delta_rule's default block
KV_BLOCK = 16  # the engine's KV block: snapshots fall on multiples of it
# (label, value heads, key dim, value dim, tokens, piece: tokens a call; 0: all in one)
CASES = [
    ("tiny-qwen3-5 layer", 8, 32, 32, 1072, 0),
    ("tiny-qwen3-5 layer, K=4 pieces", 8, 32, 32, 1072, 4 * KV_BLOCK),
    ("tiny-qwen3-5 layer, K=1 pieces", 8, 32, 32, 1072, KV_BLOCK),
    ("Qwen3-Next layer per rank", 16, 128, 128, 2048, 0),
    ("Qwen3-Next layer per rank, K=4 pieces", 16, 128, 128, 2048, 4 * KV_BLOCK),
    ("Qwen3-Next layer per rank, K=1 pieces", 16, 128, 128, 2048, KV_BLOCK),
    ("Qwen3-Next layer per rank", 16, 128, 128, 8192, 0),
]


def block_flop(n: int, dk: int, dv: int) -> int:
    """One head's matrix work on a block of n tokens, as chunked_delta_rule does it (the
    elementwise decays and gates left out): K K^T and Q K^T (full n x n, masked after),
    the two unit-triangular solves (n (n-1) multiply-adds per right-hand column), the
    intra-block product with the writes, and the four products with the state (W S0,
    Q S0, the state's update K^T U)."""
    return (2 * 2 * n * n * dk  # K K^T, Q K^T
            + n * (n - 1) * (dv + dk)  # the solves for U [n, Dv] and W [n, Dk]
            + 2 * n * n * dv  # (Q K^T * decay) @ writes
            + 3 * 2 * n * dk * dv)  # W S0, Q S0, K^T writes


def flop(num_tokens: int, heads: int, dk: int, dv: int, piece: int = 0,
         block: int = BLOCK) -> int:
    """The FLOPs of `num_tokens` through the rule in calls of `piece` tokens (0: one call),
    each call `block` tokens at a time."""
    piece = piece or num_tokens
    total = 0
    for s in range(0, num_tokens, piece):
        left = min(piece, num_tokens - s)
        for b in range(0, left, block):
            total += block_flop(min(block, left - b), dk, dv)
    return heads * total


def make_inputs(num_tokens: int, heads: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    """Random q, k, v, g, beta and a state as a layer hands them to the rule."""
    gen = torch.Generator().manual_seed(0)
    q, k = normalize_qk(torch.randn(num_tokens, heads, dk, generator=gen),
                        torch.randn(num_tokens, heads, dk, generator=gen), heads)
    v = torch.randn(num_tokens, heads, dv, generator=gen)
    g = -torch.rand(num_tokens, heads, generator=gen)  # log decays in (-1, 0]
    beta = torch.rand(num_tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def run_pieces(inputs: tuple[torch.Tensor, ...], piece: int, block: int = BLOCK,
               ) -> torch.Tensor:
    """The rule over every token, in calls of `piece` tokens as the engine makes them."""
    q, k, v, g, beta, state = inputs
    num_tokens = q.shape[0]
    piece = piece or num_tokens
    for s in range(0, num_tokens, piece):
        e = min(s + piece, num_tokens)
        _, state = chunked_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state, block)
    return state


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None, console: Console | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="cut every case to at most this many tokens (0: as listed)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for the rule and the matmul rate (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = console or Console(width=160)
    machine = describe()
    print_summary(console, machine)
    roof = machine["matmul_gflop_s"]["float32"]
    table = Table(title="chunked_delta_rule, one layer, float32, 64-token blocks; 'of matmul': "
                        f"its rate / the measured float32 matmul rate ({roof:,.0f} GFLOP/s)")
    for col in ("case", "tokens", "heads", "Dk x Dv", "piece", "ms", "tok/s", "GFLOP/s",
                "of matmul"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for label, heads, dk, dv, num_tokens, piece in CASES:
        if args.max_tokens:
            num_tokens = min(num_tokens, args.max_tokens)
        inputs = make_inputs(num_tokens, heads, dk, dv)
        seconds = best_seconds(lambda inputs=inputs, piece=piece: run_pieces(inputs, piece),
                               args.repeats)
        gflop_s = flop(num_tokens, heads, dk, dv, piece) / seconds / 1e9
        table.add_row(label, str(num_tokens), str(heads), f"{dk} x {dv}",
                      str(piece or num_tokens), f"{1000 * seconds:.2f}",
                      f"{num_tokens / seconds:,.0f}", f"{gflop_s:.1f}", f"{gflop_s / roof:.1%}")
    console.print(table)
    print_summary(console, describe(measure=False))


if __name__ == "__main__":
    main()
