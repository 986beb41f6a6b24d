"""tools/sim/trace.py: the trace load on the real scheduler in virtual time."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from tools.benchmarks.trace_load import TraceParams
from tools.sim import trace

SMALL = TraceParams(sessions=6, system_tokens=400, first_user_tokens=100,
                    turn_tokens_median=200, turns_median=6, context_limit=4096,
                    summary_tokens=300, subagent_system_tokens=300, time_scale=0.2)


def test_every_request_is_served_and_the_run_is_deterministic() -> None:
    sim = trace.SimSettings(device_tokens=4096)
    first = trace.run(SMALL, sim, "engine")
    again = trace.run(SMALL, sim, "engine")
    assert first == again
    summary = trace.summarize(first, long_pause_s=2.0)
    assert summary["requests"] == len(first) > SMALL.sessions
    assert 0 < summary["hit_ratio"] < 1 and summary["ttft_p50"] <= summary["ttft_p99"]
    assert {d.kind for d in first} >= {"turn"}


def test_held_prefixes_recompute_less_under_pressure() -> None:
    """At several times more live context than the device tier holds, waiting requests
    that hold their prefixes lose fewer of them than under plain LRU."""
    params = replace(SMALL, sessions=10, time_scale=0.1)
    # a small step budget: holds keep a step's worth of blocks free for the running ones
    sim = trace.SimSettings(device_tokens=6144, prefill_s_per_token=5e-4,
                            max_num_batched_tokens=256)
    engine = trace.summarize(trace.run(params, sim, "engine"), 2.0)
    lru = trace.summarize(trace.run(params, sim, "lru"), 2.0)
    assert lru["recomputed_seen"] > 0
    assert engine["recomputed_seen"] < lru["recomputed_seen"]


def test_main_prints_a_row_per_policy(capsys) -> None:
    trace.main(["--sessions", "3", "--system-tokens", "300", "--turns-median", "3",
                "--context-limit", "4096", "--summary-tokens", "300",
                "--subagent-system-tokens", "300", "--turn-tokens-median", "200",
                "--device-tokens", "4096", "--policies", "engine,lru"],
               Console(width=200))
    out = capsys.readouterr().out
    assert "engine" in out and "lru" in out and "hit ratio" in out
