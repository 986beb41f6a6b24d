"""tools/bench_attention.py runs and prints both paths for every case, beside the machine."""

from __future__ import annotations

import pytest
from rich.console import Console

from tools import bench_attention
from worker import cpu_kernels


def test_prints_kernel_and_sdpa_for_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    bench_attention.main(["--dtypes", "float32", "--repeats", "1"], Console(width=200))
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "GFLOP/s float32" in out
    rows = [line for line in out.splitlines() if "float32" in line and "│" in line]
    assert len(rows) == len(bench_attention.CASES)
    for (label, *_), row in zip(bench_attention.CASES, rows):
        assert label in row and row.rstrip(" │").endswith("x")  # the speed-up


def test_flop_counts_causal_keys_behind_the_prefix() -> None:
    # one head, head dim 1: 4 x (2 queries x 3 prefix keys + 1 + 2 causal keys)
    assert bench_attention.flop([(2, 5)], 1, 1) == 4 * (2 * 3 + 3)
