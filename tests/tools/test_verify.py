"""The prefix-cache quality gate (`deepinfer-verify`, `serve --self-check`): it passes
against a healthy engine, and fails, saying why, against one whose cache is off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import cache_gate
from orchestrator.cache_gate import Answer
from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import Served, wait_healthy
from tools import verify

GATE = ["--doc-tokens", "768", "--max-tokens", "6"]


def run_verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    status = verify.main([*args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def answers(warm_cached: int, other_cached: int, warm_text: str = "ok",
            warm_ttft: float = 0.1) -> dict[str, Answer]:
    return {"probe": Answer("x", 20, 0, 1, 0.05, 0.05),
            "cold": Answer("ok", 1000, 0, 4, 2.0, 3.0),
            "warm": Answer(warm_text, 1000, warm_cached, 4, warm_ttft, 1.0),
            "other": Answer("no", 1001, other_cached, 4, 0.1, 1.0)}


def test_judge_names_each_failed_check() -> None:
    ok = cache_gate.judge(answers(992, 970), block=16, max_ttft_ratio=0.5)
    assert all(c.passed for c in ok), ok
    bad = {c.name: c for c in cache_gate.judge(answers(976, 900, "other", 1.5), 16, 0.5)}
    assert not bad["repeat served from cache"].passed
    assert "976 of 1000" in bad["repeat served from cache"].detail
    assert not bad["identical answer"].passed
    assert not bad["document served from cache"].passed
    assert "101 of 1001" in bad["document served from cache"].detail
    assert not bad["warm TTFT"].passed and "0.75" in bad["warm TTFT"].detail


def test_make_document_is_fresh_per_nonce() -> None:
    a, b = cache_gate.make_document(500, "aaaa"), cache_gate.make_document(500, "bbbb")
    assert a != b and a[:30] != b[:30]  # differs from its first line: no shared block
    assert cache_gate.make_document(500, "aaaa") == a
    assert len(a) >= 500 * cache_gate.CHARS_PER_TOKEN


def test_unreachable_endpoint_fails(capsys: pytest.CaptureFixture[str]) -> None:
    status, report = run_verify(capsys, "--url", f"http://127.0.0.1:{free_port()}")
    assert status == 1 and not report["passed"] and report["reasons"]


def test_self_check_gates_a_healthy_engine_then_verify_passes(
        default_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A document long enough that the cold prefill outweighs a step's fixed cost: 4 ranks
    # on 2 cores answer any request in ~200 ms, so at 512 tokens the warm / cold TTFT ratio
    # sat at 0.42-0.54 against the gate's 0.5, and faster prefill kernels only raise it.
    engine = Served(default_model, tmp_path / "run", extra_args=[
        "--self-check", "--self-check-tokens", "2048"])
    try:  # Served waits for /health: 200 only once the self-check has passed
        assert '"self_check_passed"' in engine.log()
        for api in ("anthropic", "openai"):
            status, report = run_verify(capsys, "--url", engine.url, "--api", api, *GATE)
            assert status == 0, report["reasons"]
            warm = report["answers"]["warm"]
            assert warm["cached_tokens"] >= warm["prompt_tokens"] - report["block_size"]
            assert report["answers"]["cold"]["cached_tokens"] < report["block_size"]
    finally:
        assert engine.stop() == 0


def test_gate_fails_without_prefix_cache(default_model: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    engine = Served(default_model, tmp_path / "run", nproc=2,
                    extra_args=["--no-prefix-caching"])
    try:
        status, report = run_verify(capsys, "--url", engine.url, *GATE)
    finally:
        engine.stop()
    assert status == 1 and not report["passed"]
    reasons = " ".join(report["reasons"])
    assert "repeat served from cache: 0 of" in reasons
    assert "document served from cache" in reasons


def test_self_check_refuses_to_start_without_prefix_cache(default_model: Path,
                                                          tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", "2",
         "--run-dir", str(tmp_path / "run"), "serve", "--model", str(default_model),
         "--port", str(port), "--dtype", "float32", "--no-prefix-caching",
         "--self-check", "--self-check-tokens", "512"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    failed = [json.loads(line) for line in proc.stderr.splitlines()
              if '"self_check_failed"' in line]
    assert failed and any("repeat served from cache" in r for r in failed[0]["reasons"])
    with pytest.raises(TimeoutError):  # nothing serves on its port any more
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=1)
