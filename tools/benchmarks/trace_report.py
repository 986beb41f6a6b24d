"""What `trace.py` reports of a round: one dict per engine (JSON-ready) and the table.

Every figure is counted from what the client saw (usage, stream times), from the queue the
engine's `/metrics` showed while it ran, from its histograms' sums and counts (deltas over
the round: means, never a figure the histograms cannot give), and, where the engine logs
each request (DeepInfer's scheduler), from that log. Nothing is estimated.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tools.benchmarks.agents import percentile
from tools.benchmarks.trace_run import RequestRecord, RoundResult, Sample

SERIES_STEP_S = 5.0  # the JSON's coarse time series

# per engine: the histograms (sum and count) whose round means are reported
# (key -> (DeepInfer's name, vLLM's name)); None where the engine has no such histogram
SERVER_MEANS = {
    "server_queue_mean_s": ("deepinfer_request_queue_time_seconds",
                            "vllm:request_queue_time_seconds"),
    "server_ttft_mean_s": ("deepinfer_time_to_first_token_seconds",
                           "vllm:time_to_first_token_seconds"),
    "server_prefill_mean_s": (None, "vllm:request_prefill_time_seconds"),
}
# counters whose deltas are reported: key -> the sample names, DeepInfer's then vLLM's
SERVER_COUNTS = {
    "preemptions": (None, "vllm:num_preemptions_total"),
    "device_evictions": ("deepinfer_kv_evictions_total{tier=device}", None),
    "host_hit_tokens": ("deepinfer_prefix_cache_hit_tokens_total{tier=host}",
                        "vllm:external_prefix_cache_hits_total"),
}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _p(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def server_side(result: RoundResult) -> dict[str, float | None]:
    """Round means of the engine's own histograms and deltas of its counters (whichever
    engine it is: each has its own names; absent ones are None)."""
    b, a = result.metrics_before, result.metrics_after
    out: dict[str, float | None] = {}
    for key, names in SERVER_MEANS.items():
        out[key] = None
        for name in names:
            if name is None:
                continue
            total, count = _delta(b, a, f"{name}_sum"), _delta(b, a, f"{name}_count")
            if total is not None and count:
                out[key] = total / count
    if out["server_ttft_mean_s"] is not None and out["server_queue_mean_s"] is not None \
            and out["server_prefill_mean_s"] is None:
        # DeepInfer's: admission to first token, as the two histograms' means give it
        out["server_prefill_mean_s"] = out["server_ttft_mean_s"] - out["server_queue_mean_s"]
    for key, names in SERVER_COUNTS.items():
        out[key] = next((d for n in names if n and (d := _delta(b, a, n)) is not None), None)
    return out


def queue_figures(samples: list[Sample]) -> dict[str, Any]:
    waiting = [s.waiting for s in samples]
    running = [s.running for s in samples]
    live = [s.live_tokens for s in samples]
    buckets: dict[int, list[Sample]] = {}
    for s in samples:
        buckets.setdefault(int(s.t // SERIES_STEP_S), []).append(s)
    # [start s, max waiting, mean running, max live tokens] per SERIES_STEP_S
    series = [_bucket(i * SERIES_STEP_S, b) for i, b in sorted(buckets.items())]
    return {"samples": len(samples), "waiting_max": max(waiting, default=None),
            "waiting_mean": _mean(waiting), "running_max": max(running, default=None),
            "running_mean": _mean(running), "live_tokens_mean": _mean(live),
            "live_tokens_max": max(live, default=None), "queue_series": series}


def _bucket(edge: float, samples: list[Sample]) -> list[float]:
    return [edge, max(s.waiting for s in samples),
            round(sum(s.running for s in samples) / len(samples), 2),
            max(s.live_tokens for s in samples)]


def slow_turns(ok: list[RequestRecord], threshold_s: float | None) -> dict[str, Any]:
    """Where the time went in the requests at or above the round's TTFT p90: what the
    client saw, the queue at their send, and (where the engine logs requests) the engine's
    split of their TTFT."""
    if threshold_s is None:
        return {"requests": 0}
    slow = [r for r in ok if r.ttft_s >= threshold_s]
    logged = [r for r in slow if r.engine_ttft_s is not None and r.engine_queue_s is not None]
    return {
        "requests": len(slow), "ttft_at_least_s": threshold_s,
        "ttft_mean_s": _mean([r.ttft_s for r in slow]),
        "waiting_at_send_mean": _mean([r.waiting_at_send for r in slow
                                       if r.waiting_at_send is not None]),
        "computed_tokens_mean": _mean([r.prompt_tokens - r.cached_tokens for r in slow]),
        "recomputed_seen_mean": _mean([r.recomputed_seen for r in slow]),
        "engine_logged": len(logged),
        "engine_queue_mean_s": _mean([r.engine_queue_s for r in logged]),
        "engine_prefill_mean_s": _mean([r.engine_ttft_s - r.engine_queue_s for r in logged]),
        "outside_engine_mean_s": _mean([r.ttft_s - r.engine_ttft_s for r in logged]),
        "preemptions": sum(r.preemptions or 0 for r in logged) if logged else None,
    }



def summarize(result: RoundResult, long_pause_s: float) -> dict[str, Any]:
    """An engine's round as a dict: the headline figures first, then the breakdowns."""
    records = result.records
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    seen = sum(r.seen_tokens for r in ok)
    again = sum(r.recomputed_seen for r in ok)
    ttft = [r.ttft_s for r in ok]
    after_long = [r for r in ok if r.idle_s is not None and r.idle_s > long_pause_s]
    long_seen = sum(r.seen_tokens for r in after_long)
    long_again = sum(r.recomputed_seen for r in after_long)
    kinds = sorted({r.kind for r in records})
    logged = [r for r in ok if r.engine_queue_s is not None]
    cache = result.cache
    queue = queue_figures(result.samples)
    capacity = cache.get("num_gpu_blocks", 0) * cache.get("block_size", 0)
    server = server_side(result)
    if server["preemptions"] is None and logged:  # DeepInfer counts them in its log
        server["preemptions"] = sum(r.preemptions or 0 for r in logged)
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": result.wall_s,
        "load_avg": result.load_avg_start, "load_avg_end": result.load_avg_end,
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "seen_tokens": seen, "recomputed_seen": again,
        "recomputed_seen_share": again / seen if seen else 0.0,
        "ttft_p50_s": _p(ttft, 0.5), "ttft_p90_s": _p(ttft, 0.9), "ttft_p99_s": _p(ttft, 0.99),
        "latency_p50_s": _p([r.latency_s for r in ok], 0.5),
        "long_pause_s": long_pause_s, "after_long_pause_requests": len(after_long),
        "after_long_pause_ttft_p50_s": _p([r.ttft_s for r in after_long], 0.5),
        "after_long_pause_ttft_p90_s": _p([r.ttft_s for r in after_long], 0.9),
        "after_long_pause_recomputed_seen": long_again,
        "after_long_pause_recomputed_seen_share": long_again / long_seen if long_seen else 0.0,
        "by_kind": {k: {"requests": sum(r.kind == k for r in records),
                        "ttft_p50_s": _p([r.ttft_s for r in ok if r.kind == k], 0.5)}
                    for k in kinds},
        "kv_block_size": cache.get("block_size"),
        "kv_capacity_tokens": capacity,
        "host_capacity_tokens": cache.get("num_cpu_blocks", 0) * cache.get("block_size", 0),
        **queue,
        "live_over_kv": (queue["live_tokens_mean"] / capacity
                         if capacity and queue["live_tokens_mean"] is not None else None),
        **server,
        "engine_logged_requests": len(logged),
        "engine_queue_mean_s": _mean([r.engine_queue_s for r in logged]),
        "slow_turns": slow_turns(ok, _p(ttft, 0.9)),
    }


# --- the table --------------------------------------------------------------------------

# (key, label, format, ratio against the peer); a key with a dot reads a nested dict
ROWS = (
    ("requests", "requests", "{:,}", False),
    ("failed", "  failed", "{:,}", False),
    ("wall_s", "wall s", "{:.1f}", False),
    ("load_avg", "load average 1 min (start)", "{:.2f}", False),
    ("load_avg_end", "load average 1 min (end)", "{:.2f}", False),
    ("kv_capacity_tokens", "KV tokens the engine holds (device)", "{:,}", False),
    ("host_capacity_tokens", "  host tier", "{:,}", False),
    ("hit_ratio", "hit ratio (cached / prompt)", "{:.3f}", False),
    ("prompt_tokens", "prompt tokens", "{:,}", False),
    ("computed_tokens", "  computed (not cached)", "{:,}", True),
    ("recomputed_seen", "recomputed though seen before", "{:,}", True),
    ("recomputed_seen_share", "  share of seen tokens", "{:.3f}", False),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}", True),
    ("ttft_p90_s", "TTFT p90 s", "{:.2f}", True),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}", False),
    ("after_long_pause_requests", "after a long pause: requests", "{:,}", False),
    ("after_long_pause_ttft_p50_s", "  TTFT p50 s", "{:.2f}", True),
    ("after_long_pause_ttft_p90_s", "  TTFT p90 s", "{:.2f}", True),
    ("after_long_pause_recomputed_seen", "  recomputed though seen", "{:,}", True),
    ("waiting_max", "queue: waiting max", "{:.0f}", False),
    ("waiting_mean", "  waiting mean", "{:.2f}", False),
    ("running_mean", "  running mean", "{:.2f}", False),
    ("live_tokens_mean", "live context mean (tokens)", "{:,.0f}", False),
    ("live_tokens_max", "  max", "{:,.0f}", False),
    ("live_over_kv", "  mean / the device KV tokens", "{:.2f}", False),
    ("server_queue_mean_s", "engine: queue mean s", "{:.2f}", False),
    ("server_prefill_mean_s", "  admission to first token mean s", "{:.2f}", False),
    ("preemptions", "  preemptions", "{:,.0f}", False),
    ("device_evictions", "  device blocks evicted", "{:,.0f}", False),
    ("host_hit_tokens", "  tokens from the host tier", "{:,.0f}", False),
    ("slow_turns.requests", "slow turns (TTFT >= p90): requests", "{:,}", False),
    ("slow_turns.waiting_at_send_mean", "  waiting at send, mean", "{:.1f}", False),
    ("slow_turns.computed_tokens_mean", "  computed tokens mean", "{:,.0f}", False),
    ("slow_turns.engine_queue_mean_s", "  engine log: queue mean s", "{:.2f}", False),
    ("slow_turns.engine_prefill_mean_s", "  engine log: admission to 1st token s", "{:.2f}",
     False),
    ("slow_turns.preemptions", "  engine log: preemptions", "{:,}", False),
)


def value(row: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def ratios(runs: dict[str, dict[str, Any]], peer: str) -> dict[str, dict[str, float | None]]:
    """Each other column / the peer's, for the rows that carry a ratio (below 1 is better
    for all of them: fewer tokens recomputed, shorter times)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, row in runs.items():
        if name == peer:
            continue
        out[name] = {}
        for key, _, _, with_ratio in ROWS:
            a, b = value(row, key), value(runs[peer], key)
            out[name][key] = a / b if with_ratio and a is not None and b else None
    return out


def report_table(runs: dict[str, dict[str, Any]], peer: str, title: str) -> Table:
    q = ratios(runs, peer)
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for name in runs:
        table.add_column(name, justify="right")
    for name in q:
        table.add_column(f"{name} / {peer}", justify="right")
    for key, label, fmt, with_ratio in ROWS:
        cells = [label]
        for name in runs:
            v = value(runs[name], key)
            cells.append("-" if v is None else fmt.format(v))
        for name in q:
            r = q[name][key]
            cells.append(f"{r:.2f}x" if r is not None else "-" if with_ratio else "")
        table.add_row(*cells)
    return table
