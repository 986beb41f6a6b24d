"""tools/gpu/check.py: its CPU run end to end on tiny shapes, and the guards that keep one
device run whole (a failing step, a step out of time, a child past its deadline)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tools.benchmarks.model_flops import prefill_flop
from tools.gpu import check as gpu_check


def test_cpu_run_records_every_step(default_model: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    status = gpu_check.main([str(results), "--steps", "env,install,models,flashinfer,matmul,bench",
                             "--wheels", str(tmp_path / "no-wheels")])
    record = json.loads((results / "gpu_check.json").read_text())
    steps = {name: s["status"] for name, s in record["steps"].items()}
    assert status == 0, record
    assert record["mode"] == "cpu"
    assert steps == {"env": "ok", "install": "skipped", "models": "ok", "flashinfer": "skipped",
                     "matmul": "ok", "bench": "ok"}
    assert "no CUDA" in record["steps"]["flashinfer"]["reason"]
    assert record["steps"]["env"]["result"]["cuda_available"] is False
    head = record["headline"]
    assert head["matmul_tflop_s"] > 0 and head["prefill_tok_s"]["one_chunk"] > 0
    assert set(head["decode_tok_s"]) == set(head["decode_after_shared_prefix_tok_s"]) == {"1", "2"}
    assert 0 < head["prefill_share_of_matmul"]["one_chunk"]
    bench = json.loads((results / "bench_worker.json").read_text())
    assert bench["runs"][0]["attention_backend"] == "TorchAttentionBackend"
    # a CPU run makes its benchmark model under the results, never in the checkout
    assert (results / "models" / "bench-cpu" / "config.json").is_file()
    assert "--- bench" in (results / "gpu_check.log").read_text()


def test_cpu_run_of_the_memory_swap_and_overhead_steps(default_model: Path,
                                                        tmp_path: Path) -> None:
    results = tmp_path / "results"
    status = gpu_check.main([str(results), "--steps", "memory,swap,overhead", "--cpu"])
    record = json.loads((results / "gpu_check.json").read_text())
    assert status == 0, record
    head = record["headline"]
    assert head["memory_copy_gb_s"] > 0
    # batched copies, both slot layouts, every block count; no block-by-block baseline
    # without CUDA
    assert {k.split()[0] for k in head["swap_gb_s"]} == {"batched"}
    assert {k.split()[2] for k in head["swap_gb_s"]} == {"consecutive", "scattered"}
    assert all(out > 0 and back > 0 for out, back in head["swap_gb_s"].values())
    for name in ("overlap", "no_overlap"):
        assert set(head["overhead_engine_ms"][name]) == {"decode b1", "mixed b1", "decode b4",
                                                          "mixed b4"}
        assert set(head["overhead_idle_share_5ms"][name]) == {"decode", "mixed"}
        assert all(0 <= share < 1 for share in head["overhead_idle_share_5ms"][name].values())


def make_check(tmp_path: Path, cutoff_s: float = 100, deadline_s: float = 200) -> gpu_check.Check:
    c = gpu_check.Check(results=tmp_path, wheels=None, cuda=False, quick=True, models=tmp_path,
                        t0=time.monotonic(), cutoff_s=cutoff_s, deadline_s=deadline_s,
                        log_file=open(tmp_path / "log", "w"))  # noqa: SIM115
    c.record["steps"] = {}
    return c


def test_a_failing_step_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    c = make_check(tmp_path)

    def boom(_c):
        raise KeyError("a bug")

    def partly(_c):
        raise gpu_check.StepFailed("2 failed", {"passed": 5, "failures": 2})

    gpu_check.run_step(c, gpu_check.Step("first", boom, 0))
    gpu_check.run_step(c, gpu_check.Step("partly", partly, 0))
    gpu_check.run_step(c, gpu_check.Step("second", lambda _c: {"x": 1}, 0))
    gpu_check.run_step(c, gpu_check.Step("gpu", lambda _c: {}, 0, cuda_only=True))
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["first"]["status"] == "failed" and "KeyError" in steps["first"]["error"]
    assert steps["partly"]["status"] == "failed" and steps["partly"]["result"]["failures"] == 2
    assert steps["second"] == {**steps["second"], "status": "ok", "result": {"x": 1}}
    assert steps["gpu"]["status"] == "skipped"


def test_no_step_starts_after_the_cutoff_and_children_die_at_the_deadline(tmp_path):
    late = make_check(tmp_path, cutoff_s=-1)
    gpu_check.run_step(late, gpu_check.Step("late", lambda _c: {}, 0))
    assert late.record["steps"]["late"]["status"] == "skipped"
    assert "out of time" in late.record["steps"]["late"]["reason"]

    c = make_check(tmp_path, deadline_s=3)
    t0 = time.monotonic()
    with pytest.raises(gpu_check.StepFailed, match="timed out"):
        c.sh([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
             timeout=60)
    assert time.monotonic() - t0 < 10
    assert "started" in (tmp_path / "log").read_text()


def test_cuda_test_files_are_found():
    files = gpu_check.cuda_test_files()
    assert {"tests/worker/test_attention.py", "tests/worker/test_kv_cache.py",
            "tests/worker/test_cuda_engine.py"} <= set(files)


def test_prefill_flop_counts_linear_layers_and_causal_attention():
    from types import SimpleNamespace

    mc = SimpleNamespace(hidden_size=4, head_dim=2, num_heads=2, num_kv_heads=1,
                         intermediate_size=8, num_layers=3, vocab_size=10)
    linear = 3 * (4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8)  # qkv, o, gate/up/down
    # 5 tokens: query j reads j + 1 keys, 15 pairs a head; QK and PV 2 * head_dim each
    attention = 3 * 2 * 15 * 2 * 2 * 2
    assert prefill_flop(mc, 5) == 2 * linear * 5 + attention + 2 * 4 * 10
