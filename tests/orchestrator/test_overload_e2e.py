"""Overload, cancellation and deadlines against a served 4-rank engine: each ends as
documented, and afterwards no block is referenced and every rank agrees."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from tests.orchestrator.e2e_helpers import Served, complete
from tools import inspector as inspect_cli
from tools.benchmarks.agents_http import scrape
from tools.soak import DIGEST_MISMATCHES, USED_BLOCKS, wait_idle

RUNNING = "deepinfer_num_requests_running"
WAITING = "deepinfer_num_requests_waiting"


def assert_clean(engine: Served) -> None:
    """Idle engine: nothing referenced, nothing queued, ranks agree with the scheduler."""
    metrics = wait_idle(engine.url, timeout_s=30)
    assert metrics[USED_BLOCKS] == 0, "KV blocks leaked"
    assert metrics[RUNNING] == 0 and metrics[WAITING] == 0
    assert metrics[DIGEST_MISMATCHES] == 0
    out = io.StringIO()
    status = inspect_cli.main(["--run-dir", str(engine.run_dir), "check"],
                              console=Console(file=out, width=120, color_system=None))
    assert status == 0, out.getvalue()


@pytest.fixture(scope="module")
def engine(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    served = Served(default_model, tmp_path_factory.mktemp("overload") / "run",
                    extra_args=["--max-queued-requests", "4", "--max-num-seqs", "2"])
    yield served
    assert served.stop() == 0


def test_queue_overfill_is_refused_with_retry_after_in_each_api_shape(engine: Served) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        if i % 2:
            return await client.post(f"{engine.url}/v1/messages", json={
                "model": "m", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": f"request {i} " * 20}]})
        return await client.post(f"{engine.url}/v1/completions", json={
            "model": "m", "max_tokens": 12, "prompt": f"request {i} " * 20, "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(30)))

    responses = asyncio.run(burst())
    by_status: dict[int, list[httpx.Response]] = {}
    for r in responses:
        by_status.setdefault(r.status_code, []).append(r)
    assert set(by_status) <= {200, 429, 529}, {s: rs[0].text for s, rs in by_status.items()}
    assert len(by_status.get(200, [])) >= 4  # the 4 queue places, at the least
    refused = by_status.get(429, []) + by_status.get(529, [])
    assert refused, "30 at once into 2 slots + 4 queue places: some must be refused"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        if r.status_code == 529:
            assert r.json() == {"type": "error", "error": {
                "type": "overloaded_error", "message": r.json()["error"]["message"]}}
        else:
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert_clean(engine)


def test_deadline_gives_408_in_each_api_shape(engine: Served) -> None:
    slow = {"x-request-timeout": "0.001"}
    r = httpx.post(f"{engine.url}/v1/completions", headers=slow, timeout=60, json={
        "model": "m", "max_tokens": 50, "prompt": "tick " * 30, "ignore_eos": True})
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error", r.text
    r = httpx.post(f"{engine.url}/v1/messages", headers=slow, timeout=60, json={
        "model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "tock"}]})
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error", r.text
    r = httpx.post(f"{engine.url}/v1/completions", headers={"x-request-timeout": "soon"},
                   json={"model": "m", "max_tokens": 2, "prompt": "x"})
    assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]["message"]
    assert_clean(engine)


def test_a_hundred_clients_leave_mid_stream(default_model: Path, tmp_path: Path) -> None:
    served = Served(default_model, tmp_path / "run")
    try:
        reference = complete(served.url, prompt="after the storm", max_tokens=8,
                             temperature=0)["choices"][0]["token_ids"]

        async def leave_early(client: httpx.AsyncClient, i: int) -> int:
            body = {"model": "m", "max_tokens": 400, "prompt": f"client {i} " * 8,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{served.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        return events  # closing the stream: the client is gone
            return events

        async def storm() -> list[int]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                return await asyncio.gather(*(leave_early(client, i) for i in range(100)))

        assert asyncio.run(storm()) == [2] * 100
        assert_clean(served)
        metrics = scrape(served.url, {})
        # 100 x 400 tokens were asked for; the aborts stopped them long before that
        assert metrics['deepinfer_scheduled_tokens_total{kind=decode}'] < 100 * 100
        again = complete(served.url, prompt="after the storm", max_tokens=8, temperature=0)
        assert again["choices"][0]["token_ids"] == reference
    finally:
        assert served.stop() == 0
