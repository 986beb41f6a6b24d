"""One round of the trace against one engine over HTTP (`trace.py` runs the rounds).

Every session of `tools/benchmarks/trace_load.py` runs as its own task: it waits for its
start, then request by request for the sessions it waits for and its pause, sends the prompt
(`POST /v1/completions`, token ids, streamed, temperature 0, `ignore_eos`, an
`x-session-id` header), reads the stream and feeds the answer back; the sessions it spawns
start as tasks of their own. Beside them a poller reads the engine's `/metrics` every
`poll_s`: the queue (`vllm:num_requests_waiting`, `vllm:num_requests_running`, which both
engines serve) and the live context (the histories of the sessions that have started and
not ended, as the client holds them).

Per request it keeps what the client saw (TTFT, latency, cached tokens from the usage) and
what the engine had seen before (`SeenPrefix`, at the engine's own block size: the prompts
it had answered before this one was sent, with their answers), so that the tokens it
recomputed though it had seen them are `max(0, seen - cached)`. Where the engine logs its
own view of each request (DeepInfer's scheduler: `request_done`, with the time from arrival
to admission and to the first token, preemptions and the cached tokens per tier), the
records get it too, matched by request id.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tools.benchmarks.completions import cached_of, stream_completion
from tools.benchmarks.trace_load import (
    SeenPrefix,
    TraceParams,
    TraceSession,
    draw_tokens,
    recomputed_seen,
)

WARMUP_TOKENS = 32


@dataclass
class RequestRecord:
    """One request as the client saw it (times from the round's start)."""

    session_id: str
    kind: str
    turn: int
    sent_s: float
    idle_s: float | None  # since the session's previous answer (None: its first request)
    prompt_tokens: int
    seen_tokens: int  # leading tokens the engine had computed for earlier requests
    cached_tokens: int = 0
    recomputed_seen: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    waiting_at_send: float | None = None  # the engine's queue at the last poll before
    request_id: str = ""
    error: str | None = None
    # the engine's own log of the request (DeepInfer's scheduler), where there is one
    engine_queue_s: float | None = None  # arrival to first admission
    engine_ttft_s: float | None = None  # arrival to first token
    preemptions: int | None = None
    device_cached_tokens: int | None = None
    host_cached_tokens: int | None = None


@dataclass
class Sample:
    t: float
    waiting: float
    running: float
    kv_usage: float
    live_tokens: int  # the live sessions' histories


@dataclass
class RoundResult:
    records: list[RequestRecord]
    samples: list[Sample]
    wall_s: float
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    cache: dict[str, int]  # the engine's cache_config_info: block_size, num_gpu_blocks, ...
    load_avg_start: float
    load_avg_end: float


# --- /metrics ---------------------------------------------------------------------------


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, int]]:
    """Every sample but histogram buckets, keyed by name and its labels (the engine and
    model labels left out); and the cache_config_info labels that are numbers."""
    values: dict[str, float] = {}
    cache: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            if s.name == "vllm:cache_config_info":
                cache = {k: int(v) for k, v in s.labels.items()
                         if v.isdigit() and k != "engine"}
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("engine", "model_name"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            values[key] = values.get(key, 0.0) + s.value
    return values, cache


async def read_metrics(client: httpx.AsyncClient,
                       url: str) -> tuple[dict[str, float], dict[str, int]]:
    r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


# --- the round --------------------------------------------------------------------------


@dataclass
class _Round:
    """What the session tasks share while a round runs."""

    client: httpx.AsyncClient
    url: str
    seen: SeenPrefix
    t0: float
    timeout_s: float
    progress: tqdm
    records: list[RequestRecord] = field(default_factory=list)
    live: dict[str, int] = field(default_factory=dict)  # session -> history tokens
    ended: dict[str, asyncio.Event] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)
    waiting_now: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, session: TraceSession, delay_s: float) -> None:
        self.ended.setdefault(session.session_id, asyncio.Event())
        self.tasks.append(asyncio.create_task(self._run(session, delay_s)))

    async def _run(self, session: TraceSession, delay_s: float) -> None:
        sid = session.session_id
        await asyncio.sleep(delay_s)
        answer: list[int] | None = None
        last_answer: float | None = None
        try:
            while True:
                request = session.next_request(answer)
                for child in session.spawned():
                    self.start(child, child.start_s)
                if request is None:
                    return
                for other in request.wait_for:
                    await self.ended.setdefault(other, asyncio.Event()).wait()
                await asyncio.sleep(request.pause_before_s)
                sent = self.now()
                record = RequestRecord(
                    sid, request.kind, request.turn, sent,
                    None if last_answer is None else sent - last_answer, len(request.prompt),
                    self.seen.seen_tokens(request.prompt), waiting_at_send=self.waiting_now)
                self.records.append(record)
                self.live[sid] = len(request.prompt)
                try:
                    out = await asyncio.wait_for(
                        stream_completion(self.client, self.url, request.prompt,
                                          request.max_tokens, headers={"x-session-id": sid}),
                        self.timeout_s)
                except Exception as exc:  # the session ends here; the round goes on
                    record.error = f"{type(exc).__name__}: {exc}"[:300]
                    return
                finally:
                    self.progress.update(1)
                prompt_tokens = int(out.usage.get("prompt_tokens", 0))
                if prompt_tokens != len(request.prompt):
                    record.error = (f"{len(request.prompt)} prompt tokens sent, the usage "
                                    f"says {prompt_tokens}")
                    return
                record.cached_tokens = cached_of(out.usage)
                record.recomputed_seen = recomputed_seen(record.seen_tokens,
                                                         record.cached_tokens)
                record.output_tokens = len(out.token_ids)
                record.ttft_s, record.latency_s = out.ttft_s, out.latency_s
                record.request_id = out.request_id
                self.seen.add(request.prompt, out.token_ids)
                self.live[sid] = len(request.prompt) + len(out.token_ids)
                answer, last_answer = out.token_ids, self.now()
        finally:
            self.live.pop(sid, None)
            self.ended[sid].set()


async def _poll(r: _Round, poll_s: float, samples: list[Sample]) -> None:
    while True:
        try:
            values, _ = await read_metrics(r.client, r.url)
            r.waiting_now = values.get("vllm:num_requests_waiting", 0.0)
            samples.append(Sample(round(r.now(), 3), r.waiting_now,
                                  values.get("vllm:num_requests_running", 0.0),
                                  values.get("vllm:kv_cache_usage_perc", 0.0),
                                  sum(r.live.values())))
        except httpx.HTTPError:
            pass  # a missed sample; the next poll comes
        await asyncio.sleep(poll_s)


async def run_round(url: str, sessions: list[TraceSession], params: TraceParams,
                    poll_s: float, timeout_s: float, progress: tqdm) -> RoundResult:
    """Every session of the trace against the engine at `url`, from a warm-up request on:
    the records of every request, the queue samples and the metrics around the round."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        warmup = ([] if params.bos is None else [params.bos]) + \
            draw_tokens(params, WARMUP_TOKENS, "warmup")
        await stream_completion(client, url, warmup, 2)  # lazy init, the first forward
        before, cache = await read_metrics(client, url)
        load_start = os.getloadavg()[0]
        r = _Round(client, url, SeenPrefix(cache.get("block_size", 16)), time.perf_counter(),
                   timeout_s, progress)
        samples: list[Sample] = []
        poller = asyncio.create_task(_poll(r, poll_s, samples))
        for session in sessions:
            r.start(session, session.start_s)
        while any(not t.done() for t in r.tasks):  # sessions start more sessions
            await asyncio.gather(*list(r.tasks))
        wall_s = r.now()
        poller.cancel()
        after, _ = await read_metrics(client, url)
        r.records.sort(key=lambda x: x.sent_s)
        return RoundResult(r.records, samples, wall_s, before, after, cache, load_start,
                           os.getloadavg()[0])


def add_engine_log(records: list[RequestRecord], log_path: Path | None) -> int:
    """Fills in each record the engine's scheduler logged (`request_done`, by request id);
    how many it found."""
    if log_path is None or not log_path.is_file():
        return 0
    by_id = {r.request_id: r for r in records if r.request_id}
    found = 0
    for line in log_path.read_text(errors="replace").splitlines():
        if '"request_done"' not in line or '"scheduler"' not in line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        record = by_id.get(event.get("request_id", ""))
        if record is None or event.get("role") != "scheduler":
            continue
        record.engine_queue_s = event.get("queue_s")
        record.engine_ttft_s = event.get("ttft_s")
        record.preemptions = event.get("preemptions")
        record.device_cached_tokens = event.get("device_cached_tokens")
        record.host_cached_tokens = event.get("host_cached_tokens")
        found += 1
    return found

