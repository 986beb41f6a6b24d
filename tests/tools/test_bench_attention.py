"""tools/benchmarks/attention.py runs and prints both paths for every case, beside the machine."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from tools.benchmarks import attention as bench_attention
from worker import cpu_kernels


def test_prints_kernel_and_sdpa_for_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    bench_attention.main(["--dtypes", "float32", "--repeats", "1", "--max-layers", "1"],
                         Console(width=200))
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "GFLOP/s float32" in out
    rows = [line for line in out.splitlines() if "float32" in line and "│" in line]
    cases = bench_attention.CASES + bench_attention.DECODE_CASES
    assert len(rows) == len(cases)
    for (label, *_), row in zip(cases, rows):
        assert label in row and row.rstrip(" │").endswith("x")  # the speed-up
    assert "Decode attention" in out and "kernel GB/s" in out and "copy GB/s" in out


def test_kv_bytes_counts_k_and_v_of_every_context() -> None:
    # 2 sequences (10 + 6 tokens) x 3 KV heads x head dim 4 x 2 bytes, K and V
    assert bench_attention.kv_bytes([(1, 10), (1, 6)], 3, 4, torch.bfloat16) == 2 * 16 * 3 * 4 * 2


def test_flop_counts_causal_keys_behind_the_prefix() -> None:
    # one head, head dim 1: 4 x (2 queries x 3 prefix keys + 1 + 2 causal keys)
    assert bench_attention.flop([(2, 5)], 1, 1) == 4 * (2 * 3 + 3)


def test_make_step_shares_the_first_sequences_pages() -> None:
    """`shared` tokens: every sequence's first pages are the first sequence's (the prefix
    cache's doing), the rest its own."""
    *_, meta = bench_attention.make_step([(1, 100), (1, 70), (1, 50)], 2, 1, 4, torch.float32,
                                         shared=48)
    idx, kvp = meta.kv_indices.tolist(), meta.kv_indptr.tolist()
    pages = [idx[kvp[i]:kvp[i + 1]] for i in range(3)]
    assert [len(p) for p in pages] == [7, 5, 4]
    assert pages[1][:3] == pages[2][:3] == pages[0][:3]
    own = pages[0] + pages[1][3:] + pages[2][3:]
    assert len(set(own)) == len(own)  # nothing else shared
