"""Requests in flight survive an engine restart (`deepinfer-run --nproc-per-node 2
--restart 2 serve`, gloo): twelve requests -- completions, OpenAI chat and Anthropic
messages, streamed and not, one under a JSON schema, one sampled with a seed -- run
while rank 1, then the scheduler, is killed with SIGKILL. Every one ends whole, with the
tokens of an undisturbed run of the same requests (no token twice, none missing); the
queued ones (--max-num-seqs 8) are sent again too. Once idle, no block is referenced and
the ranks' state agrees with the scheduler's. Two launches: one with a disk tier (the
continuations' prefills then read it back), one without. With the restarts spent, a
third kill ends the requests in flight with the error they got before continuation
existed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.tools.engine import Engine

pytestmark = pytest.mark.slow
MAX_TOKENS = 120
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}


@dataclass
class Case:
    """One request, and what a client would compare between two runs of it."""

    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def completion(name: str, prompt: Any, stream: bool, **extra: Any) -> Case:
    return Case(name, "/v1/completions", {"model": "m", "prompt": prompt, "stream": stream,
                                          "max_tokens": MAX_TOKENS, "temperature": 0,
                                          "ignore_eos": True, **extra})


def chat(name: str, text: str, stream: bool, **extra: Any) -> Case:
    return Case(name, "/v1/chat/completions", {
        "model": "m", "stream": stream, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": text}], **extra})


def message(name: str, text: str, stream: bool) -> Case:
    return Case(name, "/v1/messages", {"model": "m", "stream": stream,
                                       "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "messages": [{"role": "user", "content": text}]})


# streams first: they run at once (8 sequences at most), the rest wait in the queue
CASES = [
    completion("cmpl-stream-0", list(range(100, 160)), True),
    completion("cmpl-stream-1", list(range(300, 340)), True),
    completion("cmpl-stream-sampled", list(range(500, 530)), True, temperature=0.8, seed=5),
    chat("chat-stream-0", "Tell me about the sea.", True),
    chat("chat-stream-1", "Write a poem about rain.", True),
    chat("chat-stream-json", "Where shall we go?", True, response_format={
        "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}),
    message("msg-stream-0", "Explain the tides.", True),
    message("msg-stream-1", "List some fruits.", True),
    completion("cmpl-text-stream", "Once upon a time", True),
    completion("cmpl-plain", list(range(700, 750)), False),
    chat("chat-plain", "Describe a forest.", False),
    message("msg-plain", "What is a river?", False),
]


@dataclass
class Run:
    """One case's run: what it gave (token ids or text), how it ended, progress."""

    case: Case
    answer: list[int] | str | None = None
    finish: str | None = None
    error: Any = None
    num_chunks: int = 0  # content chunks streamed so far
    pings: int = 0  # keep-alives streamed
    started: threading.Event = field(default_factory=threading.Event)


def run_case(url: str, run: Run) -> Run:
    case = run.case
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            if not case.stream:
                run.started.set()
                r = client.post(case.path, json=case.body)
                if r.status_code != 200:
                    run.error = f"HTTP {r.status_code}: {r.text}"
                    return run
                run.answer, run.finish = whole_answer(case, r.json())
                return run
            with client.stream("POST", case.path, json=case.body) as r:
                if r.status_code != 200:
                    run.error = f"HTTP {r.status_code}: {r.read().decode()}"
                    return run
                read_stream(run, r.iter_lines())
    except httpx.HTTPError as exc:  # a dropped connection: never what a client should get
        run.error = f"transport error: {exc!r}"
    finally:
        run.started.set()
    return run


def whole_answer(case: Case, body: dict[str, Any]) -> tuple[Any, str]:
    if case.path == "/v1/completions":
        choice = body["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    if case.path == "/v1/chat/completions":
        choice = body["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    return "".join(b["text"] for b in body["content"] if b["type"] == "text"), \
        body["stop_reason"]


def read_stream(run: Run, lines: Any) -> None:
    """An SSE stream's answer, as each API streams it; an error event is kept."""
    api = run.case.path
    tokens: list[int] = []
    text: list[str] = []
    for line in lines:
        if line in (": ping", "event: ping"):
            run.pings += 1
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event or event.get("type") == "error":
            run.error = event
            return
        if api == "/v1/completions":
            for choice in event["choices"]:
                tokens += choice["token_ids"]
                run.finish = choice["finish_reason"] or run.finish
        elif api == "/v1/chat/completions":
            for choice in event["choices"]:
                text.append(choice["delta"].get("content") or "")
                run.finish = choice["finish_reason"] or run.finish
        elif event["type"] == "content_block_delta":
            text.append(event["delta"]["text"])
        elif event["type"] == "message_delta":
            run.finish = event["delta"]["stop_reason"]
        run.num_chunks += 1
        if run.num_chunks >= 4:
            run.started.set()
    run.answer = tokens if api == "/v1/completions" else "".join(text)


def run_all(url: str, during: Callable[[list[Run]], None] | None = None) -> list[Run]:
    """Every case at once; `during` is called once the streams are under way."""
    runs = [Run(case) for case in CASES]
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = []
        for run in runs:  # in order: the streams take the running slots first
            futures.append(pool.submit(run_case, url, run))
            time.sleep(0.05)
        if during is not None:
            during(runs)
        for future in futures:
            future.result(timeout=600)
    return runs


def kill_mid_stream(engine: Engine, process: str) -> Callable[[list[Run]], None]:
    def kill(runs: list[Run]) -> None:
        streams = [r for r in runs if r.case.stream][:6]
        for run in streams:  # the first streams are under way
            assert run.started.wait(120), f"{run.case.name} never streamed: {run.error}"
        os.kill(engine.pids()[process], signal.SIGKILL)
    return kill


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(url: str, name: str, **labels: str) -> float:
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def assert_same(runs: list[Run], reference: dict[str, Run]) -> None:
    for run in runs:
        name = run.case.name
        assert run.error is None, (name, run.error)
        want = reference[name]
        assert (run.answer, run.finish) == (want.answer, want.finish), name
        assert run.answer, name  # something was generated


def assert_idle_and_agreed(engine: Engine) -> None:
    """No block is referenced once every request ended, and every rank's block tables,
    tier contents and digest agree with the scheduler's."""
    def idle() -> bool:
        m = metrics(engine.url)
        return (m.get(("deepinfer_num_requests_running", ()), 1) == 0
                and m.get(("deepinfer_num_requests_waiting", ()), 1) == 0)
    engine.wait_for("the engine idle", idle)
    status, view = engine.inspect_json("cache")
    assert status == 0 and view["usage"]["device"]["used"] == 0, view["usage"]
    status, text = engine.inspect("check")
    assert status == 0, text


def resumed_lines(engine: Engine) -> list[dict]:
    return engine.events("request_resumed")


def check_a_kill(engine: Engine, reference: dict[str, Run], process: str,
                 attempt: int) -> list[Run]:
    """Kill `process` mid-stream; every request ends whole and as the reference."""
    resumed_before = metric(engine.url, "deepinfer_requests_resumed_total")
    lines_before = len(resumed_lines(engine))
    runs = run_all(engine.url, kill_mid_stream(engine, process))
    assert_same(runs, reference)
    (restart,) = [e for e in engine.events("engine_restarting") if e["attempt"] == attempt]
    assert process in restart["cause"] and "SIGKILL" in restart["cause"]
    resumed = metric(engine.url, "deepinfer_requests_resumed_total") - resumed_before
    lines = resumed_lines(engine)[lines_before:]
    # the streams under way and the queued requests at least; every one logged, paused
    assert resumed >= 10 and len(lines) == resumed, (resumed, lines)
    assert all(line["pause_s"] > 0 for line in lines)
    assert {line["attempt"] for line in lines} == {1}
    assert sum(line["resumed_tokens"] > 0 for line in lines) >= 6
    assert metric(engine.url, "deepinfer_request_resume_pause_seconds_count") \
        == metric(engine.url, "deepinfer_requests_resumed_total")
    assert not any(v for (name, _), v in metrics(engine.url).items()
                   if name == "deepinfer_requests_resume_failed_total")
    assert_idle_and_agreed(engine)
    return runs


def start(model: Path, tmp_path: Path, *args: str) -> Engine:
    return Engine(model, tmp_path / "run", "--max-num-seqs", "8", *args, nproc=2,
                  launcher_args=["--restart", "2", "--resume-timeout", "120"])


def test_requests_survive_kills_with_a_disk_tier(default_model, tmp_path):
    engine = start(default_model, tmp_path, "--host-cache-memory", str(8 << 20),
                   "--disk-cache-dir", str(tmp_path / "disk"),
                   "--disk-cache-size", str(32 << 20))
    try:
        reference = {r.case.name: r for r in run_all(engine.url)}
        for run in reference.values():
            assert run.error is None and run.answer, (run.case.name, run.error)
        time.sleep(1.0)  # the ranks' background writes of the reference land on disk
        disk_hits = metric(engine.url, "deepinfer_prefix_cache_hit_tokens_total", tier="disk")
        check_a_kill(engine, reference, "rank 1", attempt=1)
        # the restarted engine's device and host tiers start empty: the prompts and the
        # resumed outputs came back from the disk
        assert metric(engine.url, "deepinfer_prefix_cache_hit_tokens_total",
                      tier="disk") > disk_hits
        check_a_kill(engine, reference, "scheduler", attempt=2)

        # the restarts are spent: a third death ends what is in flight with its error
        runs = run_all(engine.url, kill_mid_stream(engine, "rank 1"))
        engine.proc.wait(timeout=60)
        for run in runs:  # an error event mid-stream (OpenAI's type, Anthropic's), or a 503
            if run.case.stream and isinstance(run.error, dict):
                assert run.error["error"]["type"] in ("service_unavailable", "api_error")
            else:
                assert str(run.error).startswith("HTTP 503"), (run.case.name, run.error)
        assert {e["reason"] for e in engine.events("request_not_resumed")} == {"stopping"}
    finally:
        engine.stop()


def test_requests_survive_kills_without_a_disk_tier(default_model, tmp_path):
    engine = start(default_model, tmp_path)
    try:
        reference = {r.case.name: r for r in run_all(engine.url)}
        for run in reference.values():
            assert run.error is None and run.answer, (run.case.name, run.error)
        check_a_kill(engine, reference, "rank 1", attempt=1)
        check_a_kill(engine, reference, "scheduler", attempt=2)
    finally:
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]
