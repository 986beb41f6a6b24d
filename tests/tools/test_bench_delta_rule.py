"""tools/benchmarks/delta_rule.py: its FLOP count, and what it prints beside the machine."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from torch.utils.flop_counter import FlopCounterMode

from tools.benchmarks import delta_rule as bench


def test_flop_count_of_a_hand_computed_case() -> None:
    # 3 tokens in blocks of 2 (a block of 2, then 1), one head, Dk 2, Dv 1. A block of n:
    # K K^T and Q K^T 2 * 2n^2 Dk, the solves n (n - 1) (Dv + Dk), (Q K^T) @ writes 2n^2 Dv,
    # three products with the state 3 * 2n Dk Dv. n = 2: 32 + 6 + 8 + 24; n = 1: 8 + 0 + 2 + 12
    assert bench.flop(3, heads=1, dk=2, dv=1, block=2) == 70 + 22
    # in calls of 2 tokens: two blocks of 2; heads multiply
    assert bench.flop(4, heads=3, dk=2, dv=1, piece=2, block=2) == 3 * 2 * 70


def test_flop_count_matches_the_products_the_rule_runs() -> None:
    """torch counts the rule's matrix products (not its triangular solves): the count less
    the solves is theirs."""
    tokens, heads, dk, dv, block = 45, 2, 8, 4, 16  # blocks of 16, 16 and 13
    inputs = bench.make_inputs(tokens, heads, dk, dv)
    with FlopCounterMode(display=False) as counter:
        bench.run_pieces(inputs, 0, block=block)
    solves = heads * sum(n * (n - 1) * (dk + dv) for n in (16, 16, 13))
    assert counter.get_total_flops() == bench.flop(tokens, heads, dk, dv, block=block) - solves


def test_prints_every_case_beside_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        bench.main(["--repeats", "1", "--max-tokens", "40", "--threads", "1"],
                   Console(width=200))
    finally:
        torch.set_num_threads(threads)  # --threads sets them for the whole process
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "GFLOP/s float32" in out and "load average" in out
    assert "of matmul" in out
    rows = [line for line in out.splitlines() if "│" in line]
    for label, *_ in bench.CASES:
        row = next(r for r in rows if f" {label} " in r)
        assert row.rstrip(" │").endswith("%")  # its share of the matmul rate
