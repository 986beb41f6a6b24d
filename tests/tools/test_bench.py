"""tools/benchmarks/agents_http.py: the coding-agent benchmark over HTTP, end to end on small
settings."""

from __future__ import annotations

import io
import json
import signal

import pytest
from rich.console import Console

from tools.benchmarks.agents_http import main, queue_wait_ms, summarize
from tools.harness.served import Served

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--agents", "2", "--turns", "3", "--system-tokens", "512", "--tool-result-tokens",
         "32", "--max-tokens", "4", "--think-s", "0.05"]


def run_bench(argv: list[str]) -> tuple[dict, str]:
    out = io.StringIO()
    assert main(argv, console=Console(file=out, width=200, color_system=None)) == 0
    return json.loads(open(argv[argv.index("--json") + 1]).read()), out.getvalue()


def test_cache_on_and_off_over_http(default_model, tmp_path):
    result, printed = run_bench(["--model", str(default_model), "--nproc-per-node", "2",
                                 *SMALL, "--json", str(tmp_path / "r.json"),
                                 "--plot", str(tmp_path / "r.png")])
    on, off = result["runs"]["on"], result["runs"]["off"]
    assert on["requests"] == off["requests"] == 6
    # the same prompts both times (temperature 0), each above the shared system prompt
    assert on["prompt_tokens"] == off["prompt_tokens"] > 6 * 512
    # a shared system prompt resent by every turn: most of it comes from the cache
    assert on["device_hit_share"] > 0.5, on
    assert on["cached_share"] == pytest.approx(on["device_hit_share"] + on["host_hit_share"])
    assert off["cached_share"] == off["device_hit_share"] == off["host_hit_share"] == 0
    for r in (on, off):
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] <= r["ttft_p99_ms"]
        assert r["output_tokens"] > 0 and r["queue_mean_ms"] is not None
        assert r["prefix_breaks"] == 0  # every prompt extends the previous one
    assert result["ratios"]["read_rate_on_off"] > 0
    assert (tmp_path / "r.png").read_bytes().startswith(PNG_MAGIC)
    assert "read-rate ratio cache on/off" in printed


def test_url_benches_a_running_endpoint_once(default_model, tmp_path):
    engine = Served(default_model, tmp_path / "run", nproc=1, extra_args=["--api-key", "k"])
    try:
        result, printed = run_bench(["--url", engine.url, "--api-key", "k", "--agents", "1",
                                     "--turns", "2", "--system-tokens", "256",
                                     "--max-tokens", "2", "--think-s", "0",
                                     "--json", str(tmp_path / "u.json")])
    finally:
        assert engine.stop(signal.SIGINT) == 0
    assert list(result["runs"]) == ["endpoint"] and result["ratios"] is None
    assert "api_key" not in result["args"]
    assert result["runs"]["endpoint"]["requests"] == 2
    assert result["runs"]["endpoint"]["device_hit_share"] > 0  # turn 2 reads turn 1's prompt
    assert (tmp_path / "u.png").read_bytes().startswith(PNG_MAGIC)
    assert "ratio" not in printed


def test_queue_wait_from_a_histogram_delta():
    name = "deepinfer_request_queue_time_seconds"
    delta = {f"{name}_count": 20.0, f"{name}_sum": 2.0, f"{name}_bucket{{le=0.01}}": 10.0,
             f"{name}_bucket{{le=0.1}}": 18.0, f"{name}_bucket{{le=1.0}}": 20.0,
             f"{name}_bucket{{le=+Inf}}": 20.0}
    assert queue_wait_ms(delta) == (100.0, 1000.0)  # mean 0.1 s; the 19th falls in (0.1, 1]
    assert queue_wait_ms({}) == (None, None)


def test_summarize_without_metrics_keeps_the_usage_figures():
    from tools.benchmarks.agents_http import Step

    steps = [Step(0, 0, 0.0, 0.5, 1.0, 100, 0, 4), Step(0, 1, 1.0, 0.1, 0.4, 120, 96, 4)]
    r = summarize(steps, 2.0, None, None)
    assert r["prompt_tokens"] == 220 and r["cached_share"] == pytest.approx(96 / 220)
    assert r["prompt_tokens_read_per_s"] == 110 and r["output_tokens_per_s"] == 4
    assert r["device_hit_share"] is None and r["queue_mean_ms"] is None
