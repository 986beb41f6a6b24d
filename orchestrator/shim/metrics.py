"""Prometheus metrics served by the shim at /metrics.

Engine figures (queue, steps, prefix cache, tier usage, the scheduler's histograms)
come from the scheduler as one `EngineStats` snapshot per scrape; they are exported
through a custom collector so the scheduler stays the only owner of its counters.
Latencies a client sees (time to first token, inter-token latency) are observed here,
where outputs arrive (`RequestTimer`, driven by the engine client), and so are the
prefix breaks the shim detects and the content blocks it replaced by placeholders.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from wire.client import UNCACHED_REASONS, EngineStats, HistogramData, RequestOutput
from wire.control import PrefixBreak

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_CACHE_COUNTERS = {
    "num_queried_tokens": ("prefix_cache_queried_tokens", "Prompt tokens looked up"),
    "num_swap_in_blocks": ("kv_swap_in_blocks", "Blocks copied host -> device"),
    "num_swap_out_blocks": ("kv_swap_out_blocks", "Blocks copied device -> host"),
}
# EngineStats.histograms key -> (name, help, label value for a `kind` label or None)
_HISTOGRAMS = {
    "queue_seconds": ("deepinfer_request_queue_time_seconds",
                      "Time from arrival to first admission", None),
    "step_seconds": ("deepinfer_step_duration_seconds",
                     "Time from sending a step plan to every rank's answer", None),
    "step_prefill_tokens": ("deepinfer_step_tokens", "Tokens run per step", "prefill"),
    "step_decode_tokens": ("deepinfer_step_tokens", "Tokens run per step", "decode"),
    "spec_accepted_drafts": ("deepinfer_spec_acceptance_length",
                             "Draft tokens the model kept per drafted decode", None),
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
               1.0, 2.5)


class EngineCollector:
    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        # set at start-up from the engine's EngineInfo and the served name
        self.model_name = ""
        self.block_size = 0

    def collect(self):
        s = self.stats
        if s is None:
            return
        yield from vllm_metrics(s, self.model_name, self.block_size)
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
        hits.add_metric(["disk"], s.cache.get("num_disk_hit_tokens", 0))
        yield hits
        yield _uncached(s)
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
        yield from _disk_metrics(s)
        blocks = GaugeMetricFamily("deepinfer_kv_blocks", "KV blocks by tier and state",
                                   labels=["tier", "state"])
        retained = GaugeMetricFamily(
            "deepinfer_kv_retained_tokens",
            "Cached tokens kept for a client's retention hint (cache_control)", labels=["tier"])
        for tier, usage in s.usage.items():
            for state in ("used", "cached", "free", "capacity", "retained"):
                blocks.add_metric([tier, state], usage.get(state, 0))
            retained.add_metric([tier], usage.get("retained_tokens", 0))
        yield blocks
        yield retained
        if s.state_usage:  # a hybrid model's linear-attention state snapshots
            slots = GaugeMetricFamily("deepinfer_state_slots",
                                      "Linear-attention state slots by tier and state",
                                      labels=["tier", "state"])
            for tier, usage in s.state_usage.items():
                for state in ("used", "cached", "free", "capacity"):
                    slots.add_metric([tier, state], usage.get(state, 0))
            yield slots
        early = CounterMetricFamily(
            "deepinfer_kv_retained_evictions",
            "Retained blocks evicted before their TTL (0 while they fit under the cap)",
            labels=["tier"])
        early.add_metric(["device"], s.cache.get("num_device_retained_evictions", 0))
        early.add_metric(["host"], s.cache.get("num_host_retained_evictions", 0))
        yield early
        yield _counter("deepinfer_rank_digest_mismatches",
                       "Steps where a rank's state digest differed from the scheduler's",
                       s.num_digest_mismatches)
        yield _counter("deepinfer_spec_draft_tokens", "Draft tokens proposed (speculative "
                       "decoding)", s.num_spec_draft_tokens)
        yield _counter("deepinfer_spec_accepted_tokens", "Draft tokens the model kept",
                       s.num_spec_accepted_tokens)
        yield from _histograms(s.histograms)


def vllm_metrics(s: EngineStats, model_name: str, block_size: int):
    """The figures a router scrapes from a vLLM server, under vLLM's names and labels:
    SMG, llm-d's endpoint picker and Dynamo read these to weigh replicas by load and
    cache. vLLM's meaning is kept: KV usage counts blocks some request holds (cached,
    unreferenced ones are free to take), and prefix_cache_hits are device hits (the host
    tier's are the "external" ones, as vLLM counts a KV connector's)."""
    labels, values = ["engine", "model_name"], ["0", model_name]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(values, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        return c

    device = s.usage.get("device", {})
    capacity = device.get("capacity", 0)
    yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed", s.num_waiting)
    yield gauge("vllm:num_requests_running", "Requests in model execution batches",
                s.num_running)
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent)",
                device.get("used", 0) / capacity if capacity else 0.0)
    c = s.cache
    yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens",
                  c.get("num_queried_tokens", 0))
    yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens",
                  c.get("num_device_hit_tokens", 0))
    yield counter("vllm:external_prefix_cache_queries",
                  "Host-tier cache queries, in queried tokens", c.get("num_queried_tokens", 0))
    yield counter("vllm:external_prefix_cache_hits", "Host-tier cache hits, in cached tokens",
                  c.get("num_host_hit_tokens", 0))
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config",
                             labels=["engine", "block_size", "num_gpu_blocks",
                                     "num_cpu_blocks"])
    info.add_metric(["0", str(block_size), str(capacity),
                     str(s.usage.get("host", {}).get("capacity", 0))], 1.0)
    yield info


def _uncached(s: EngineStats) -> CounterMetricFamily:
    """Prompt tokens the cache did not serve, by why (cache/miss_reasons.py), counted by
    the scheduler at each request's first admission -- so a request whose client left
    counts too, and a preempted one once."""
    family = CounterMetricFamily(
        "deepinfer_prompt_tokens_uncached", "Prompt tokens computed rather than served from "
        "the prefix cache, by reason (evicted, diverged, compaction, salt, no_room, no_state, "
        "new, block_remainder)", labels=["reason"])
    for reason in UNCACHED_REASONS:
        family.add_metric([reason], s.cache.get(f"num_uncached_{reason}_tokens", 0))
    return family


def _disk_metrics(s: EngineStats):
    """The disk tier's own figures (EngineStats.disk, from the ranks' results and the
    scheduler's disk index); nothing when it is off."""
    d = s.disk
    if not d:
        return
    io = CounterMetricFamily("deepinfer_disk_bytes", "KV bytes moved to and from the disk "
                             "tier, per rank", labels=["direction"])
    io.add_metric(["read"], d.get("num_read_blocks", 0) * s.kv_bytes_per_block)
    io.add_metric(["written"], d.get("num_committed_writes", 0) * s.kv_bytes_per_block)
    yield io
    yield _gauge("deepinfer_disk_write_queue_depth",
                 "Disk writes queued on the busiest rank", d.get("queue_depth", 0))
    yield _counter("deepinfer_disk_dropped_writes",
                   "Disk writes dropped by a rank (queue full or disk error)",
                   d.get("num_dropped_writes", 0))
    yield _gauge("deepinfer_disk_blocks_found_after_restart",
                 "Disk blocks every rank found valid at start-up", d.get("found_at_start", 0))
    yield _gauge("deepinfer_disk_torn_blocks_dropped",
                 "Disk blocks dropped at start-up (damaged, or not on every rank)",
                 d.get("torn_at_start", 0))


def _histograms(data: dict[str, HistogramData]):
    families: dict[str, HistogramMetricFamily] = {}
    for key, (name, doc, kind) in _HISTOGRAMS.items():
        h = data.get(key)
        if h is None:
            continue
        if name not in families:
            families[name] = HistogramMetricFamily(name, doc,
                                                    labels=["kind"] if kind else None)
        cumulative, buckets = 0, []
        for bound, count in zip([*h.bounds, float("inf")], h.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        families[name].add_metric([kind] if kind else [], buckets, h.sum)
    yield from families.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        r = self.registry
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds",
                              "Time from sending a request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds",
                             "Time between output tokens of a request (per token)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer_request_duration_seconds",
                             "Time from sending a request to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("deepinfer_requests", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of ended requests",
                                     registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens",
                                         "Tokens generated", registry=r)
        self.reasoning_tokens = Counter(
            "deepinfer_reasoning_tokens", "Generated tokens inside a reasoning model's "
            "<think> span (a share of deepinfer_generation_tokens)", registry=r)
        self.guided_requests = Counter(
            "deepinfer_guided_requests", "Chat requests whose answer a grammar held, by what "
            "asked for it (response_format / output_config, or a tool_choice that requires a "
            "call)", ["by"], registry=r)
        self.unsupported_blocks = Counter(
            "deepinfer_unsupported_blocks", "Content blocks the model cannot read (images, "
            "documents, server tool results, ...) replaced by a text placeholder, by type; "
            "a block resent in each turn of a conversation counts each time",
            ["type"], registry=r)
        self.client_sessions = Counter(
            "deepinfer_client_session_requests", "Responses API requests by where their "
            "session id came from (prompt_cache_key, the session-id header, or none: a "
            "digest of the conversation's start stands for it)", ["api", "source"],
            registry=r)
        self.prompt_normalised = Counter(
            "deepinfer_prompt_normalised", "Prompts the engine changed so that sessions share "
            "their prefix, by what it changed (billing_header: Claude Code's per-session "
            "header left out; --billing-header keep turns it off)", ["what"], registry=r)
        self.prefix_breaks = Counter(
            "deepinfer_prefix_breaks", "Prompts that did not extend their session's previous "
            "prompt plus output (see the prefix_break log lines)", registry=r)
        self.recent_prefix_breaks: deque[PrefixBreak] = deque(maxlen=64)
        self.requests_resumed = Counter(
            "deepinfer_requests_resumed", "Requests in flight when the engine died that went "
            "on from the restarted engine (deepinfer-run --restart)", registry=r)
        self.requests_not_resumed = Counter(
            "deepinfer_requests_resume_failed", "Requests in flight when the engine died that "
            "ended with its error instead, by why: timeout (no engine back within "
            "--resume-timeout), deadline (the request's own came first), stopping (no "
            "restart left: the server stopped)", ["reason"], registry=r)
        self.resume_pause = Histogram(
            "deepinfer_request_resume_pause_seconds", "The pause a continued request's "
            "client saw: from its last token before the engine died (or the loss, if none "
            "had come) to its next", buckets=LATENCY_BUCKETS, registry=r)
        # Set by the engine client: forwards each prefix break to the scheduler, so that
        # `deepinfer-inspect cache` lists them next to the cache they explain.
        self.reporter: Callable[[object], None] | None = None

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int = 0) -> RequestTimer:
        """A timer for one request, started now (call just before sending it)."""
        return RequestTimer(self, num_prompt_tokens)

    def count_prefix_break(self, session: str = "", *, request_id: str = "",
                           num_common_tokens: int = 0, num_prompt_tokens: int = 0,
                           reason: str = "") -> None:
        """A session's new prompt does not extend its previous one (the details are
        optional: they are kept for `deepinfer-inspect cache`)."""
        self.prefix_breaks.inc()
        report = PrefixBreak(session, request_id, num_common_tokens, num_prompt_tokens,
                             reason, time.time())
        self.recent_prefix_breaks.append(report)
        if self.reporter is not None:
            self.reporter(report)


class RequestTimer:
    """Observes one request's latencies as its outputs arrive."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int = 0) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.t0 = time.monotonic()
        self.last: float | None = None  # when the previous token arrived
        self.num_tokens = 0
        self.num_reasoning_tokens = 0  # the engine's running count (RequestOutput)
        self.done = False

    def output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        n = len(out.token_ids)
        if n:
            m = self.metrics
            if self.last is None:
                m.ttft.observe(now - self.t0)
            else:
                for _ in range(n):  # tokens batched in one output share the gap
                    m.itl.observe((now - self.last) / n)
            self.last = now
            self.num_tokens += n
        self.num_reasoning_tokens = max(self.num_reasoning_tokens, out.num_reasoning_tokens)
        if out.finished:
            self.end(out.finish_reason or "stop", out.num_prompt_tokens)

    def end(self, finish_reason: str, num_prompt_tokens: int = 0) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.t0)
        m.requests.labels(finish_reason).inc()
        m.prompt_tokens.inc(num_prompt_tokens or self.num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.reasoning_tokens.inc(self.num_reasoning_tokens)
