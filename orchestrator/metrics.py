"""Prometheus metrics served by the shim at /metrics.

Engine figures (queue, steps, prefix cache, tier usage) come from the scheduler as
one `EngineStats` snapshot per scrape; they are exported through a custom collector
so the scheduler stays the only owner of its counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_CACHE_COUNTERS = {
    "num_queried_tokens": ("prefix_cache_queried_tokens", "Prompt tokens looked up"),
    "num_swap_in_blocks": ("kv_swap_in_blocks", "Blocks copied host -> device"),
    "num_swap_out_blocks": ("kv_swap_out_blocks", "Blocks copied device -> host"),
}


class EngineCollector:
    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        yield _gauge("deepinfer_num_requests_waiting", "Requests in the queue", s.num_waiting)
        yield _gauge("deepinfer_num_requests_running", "Requests running", s.num_running)
        yield _counter("deepinfer_steps", "Engine steps run", s.step)
        yield _counter("deepinfer_step_seconds", "Time spent in engine steps", s.step_seconds)
        tokens = CounterMetricFamily("deepinfer_scheduled_tokens",
                                     "Tokens run through the model", labels=["kind"])
        tokens.add_metric(["prefill"], s.num_prefill_tokens)
        tokens.add_metric(["decode"], s.num_decode_tokens)
        yield tokens
        for key, (name, doc) in _CACHE_COUNTERS.items():
            yield _counter(f"deepinfer_{name}", doc, s.cache.get(key, 0))
        hits = CounterMetricFamily("deepinfer_prefix_cache_hit_tokens",
                                   "Prompt tokens served from cache", labels=["tier"])
        hits.add_metric(["device"], s.cache.get("num_device_hit_tokens", 0))
        hits.add_metric(["host"], s.cache.get("num_host_hit_tokens", 0))
        yield hits
        evictions = CounterMetricFamily("deepinfer_kv_evictions",
                                        "Cached blocks reused for other data", labels=["tier"])
        evictions.add_metric(["device"], s.cache.get("num_device_evictions", 0))
        evictions.add_metric(["host"], s.cache.get("num_host_evictions", 0))
        yield evictions
        swapped = CounterMetricFamily("deepinfer_kv_swap_bytes",
                                      "KV bytes copied between tiers, per rank",
                                      labels=["direction"])
        swapped.add_metric(["in"], s.cache.get("num_swap_in_blocks", 0) * s.kv_bytes_per_block)
        swapped.add_metric(["out"], s.cache.get("num_swap_out_blocks", 0) * s.kv_bytes_per_block)
        yield swapped
        blocks = GaugeMetricFamily("deepinfer_kv_blocks", "KV blocks by tier and state",
                                   labels=["tier", "state"])
        for tier, usage in s.usage.items():
            for state in ("used", "cached", "free", "capacity"):
                blocks.add_metric([tier, state], usage.get(state, 0))
        yield blocks


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        self.prefix_breaks = Counter(
            "deepinfer_prefix_breaks", "Prompts that did not extend their session's previous "
            "prompt plus output (see the prefix_break log lines)", registry=self.registry)

    def count_prefix_break(self, session: str = "", *, request_id: str = "",
                           num_common_tokens: int = 0, num_prompt_tokens: int = 0,
                           reason: str = "") -> None:
        """A session's new prompt does not extend its previous one (details: the
        prefix_break log line)."""
        self.prefix_breaks.inc()

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
