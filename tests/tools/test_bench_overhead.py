"""tools/benchmarks/overhead.py on tiny settings: one rank, two batches, both modes, an idle
cell."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from tools.benchmarks.overhead import cpu_bound_ms, main

pytestmark = pytest.mark.slow

# the scheduler's path through a step; with overlap (the default) the ranks' parts run
# beside it, and transport is not measurable
SCHEDULER_PARTS = ("plan", "digest", "encode", "waiting", "result_decode", "results", "check",
                   "other")


def test_bench_overhead_smoke(default_model, tmp_path):
    out = io.StringIO()
    path = tmp_path / "overhead.json"
    status = main(["--model", str(default_model), "--world-sizes", "1", "--batches", "1,8",
                   "--steps", "6", "--warmup-steps", "1", "--output-tokens", "2",
                   "--idle-forward-ms", "2", "--idle-batch", "8", "--idle-world-sizes", "1",
                   # the pytest process keeps its own CPU policy (cpu_policy has its test)
                   "--scheduler-policy", "normal", "--no-machine-rates", "--json", str(path)],
                  console=Console(file=out, width=240, color_system=None))
    printed = out.getvalue()
    result = json.loads(path.read_text())
    assert status == 0, result["problems"]
    rows = result["results"]
    assert [(r["forward_ms"], r["batch"], r["mode"]) for r in rows] == [
        (0, 1, "decode"), (0, 1, "mixed"), (0, 8, "decode"), (0, 8, "mixed"),
        (2, 8, "decode"), (2, 8, "mixed")]
    for r in rows:
        b = r["breakdown_ms"]
        assert r["steps"] == 6 and r["steps_per_s"] > 0
        # the parts add up to the step, and the engine's time is the step less the forward
        assert sum(b[k] for k in SCHEDULER_PARTS) == pytest.approx(b["step"])
        assert b["engine"] == pytest.approx(b["step"] - b["forward"])
        assert b["transport"] is None and b["waiting"] >= 0 and 0 < r["idle_share"] <= 1
        assert min(b[k] for k in ("rank_decode", "rank_apply", "rank_prepare")) > 0
        assert 0 < b["sched_cpu"] <= b["step"] and b["rank_cpu"] > 0
        assert r["cpu_bound_ms"] >= max(b["sched_cpu"], b["rank_cpu"])
    decode8, mixed8, idle = rows[2], rows[3], rows[4]
    assert decode8["chunks_per_step"] == 8 and decode8["prefill_tokens_per_step"] == 0
    assert mixed8["prefill_tokens_per_step"] > 0
    assert mixed8["counters"]["host_hit_tokens"] > 0 and mixed8["counters"]["swap_in_blocks"] > 0
    assert idle["breakdown_ms"]["forward"] >= 2  # the sleep is a lower bound
    assert "machine:" in printed and "Engine overhead" in printed
    assert "the ranks idle" in printed and "load average" in printed
    assert "sched" in printed and "bound" in printed


def test_cpu_bound_is_the_busiest_process_or_the_cores_shared():
    b = {"sched_cpu": 0.4, "rank_cpu": 0.2}
    assert cpu_bound_ms(b, 1, 2) == 0.4  # a core each: the scheduler's own CPU
    assert cpu_bound_ms(b, 4, 2) == pytest.approx(0.6)  # 5 processes take turns on 2 cores
    assert cpu_bound_ms(b, 4, 8) == 0.4
    assert cpu_bound_ms({"sched_cpu": 0.1, "rank_cpu": 0.3}, 2, 4) == 0.3


def test_bench_overhead_breakdown_without_overlap(default_model, tmp_path):
    """Steps one after another: the ranks' parts and the transport are in the scheduler's
    path, and every part together is the step."""
    path = tmp_path / "overhead.json"
    status = main(["--model", str(default_model), "--world-sizes", "1", "--batches", "4",
                   "--modes", "decode", "--steps", "6", "--warmup-steps", "1",
                   "--idle-world-sizes", "", "--no-async-scheduling", "--no-machine-rates",
                   "--scheduler-policy", "normal", "--json", str(path)],
                  console=Console(file=io.StringIO(), width=240))
    result = json.loads(path.read_text())
    assert status == 0, result["problems"]
    (row,) = result["results"]
    b = row["breakdown_ms"]
    ranks = ("rank_decode", "rank_apply", "rank_digest", "rank_prepare", "forward", "transport")
    path_parts = tuple(k for k in SCHEDULER_PARTS if k != "waiting") + ranks + ("waiting",)
    assert sum(b[k] for k in path_parts) == pytest.approx(b["step"])
    assert b["transport"] > 0
