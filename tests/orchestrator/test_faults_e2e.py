"""Faults end to end (`deepinfer-run serve`, 2 ranks on gloo): a rank killed with -9 or
hung in the middle of a long streamed completion.

Every test checks what a client sees (the request in flight ends with an error, never
a hung connection) and what the log says (the rank, by number). With --restart the
shim answers 503 + retry-after to new requests while the engine group comes back, then
serves again (here with --resume-timeout 0: the request in flight is not continued).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.orchestrator.e2e_helpers import alive, complete
from tests.tools.engine import Engine
from tests.worker.faults import with_faults

pytestmark = pytest.mark.slow
LONG = {"model": "default", "prompt": list(range(100, 140)), "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True}


class InFlight(threading.Thread):
    """A long streamed completion: how many tokens came, and how it ended."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.num_tokens = 0
        self.streaming = threading.Event()  # set once tokens flow
        self.error: dict | str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=LONG,
                              timeout=60) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode()}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            self.error = event["error"]
                        for choice in event.get("choices", []):
                            self.num_tokens += len(choice["token_ids"])
                        if self.num_tokens >= 4:
                            self.streaming.set()
        except httpx.HTTPError as exc:  # a dropped connection: not what clients should get
            self.error = f"transport error: {exc!r}"
        finally:
            self.streaming.set()

    def wait_ended(self, timeout_s: float = 30) -> None:
        self.join(timeout_s)
        assert not self.is_alive(), "the request in flight hangs"
        assert self.error is not None and self.num_tokens < LONG["max_tokens"], self.error


def start_long_request(engine: Engine) -> InFlight:
    request = InFlight(engine.url)
    request.start()
    assert request.streaming.wait(60) and request.error is None, request.error
    return request


def assert_unavailable_event(request: InFlight) -> None:
    """Mid-stream, the error is an SSE event: the OpenAI error object, "unavailable"."""
    assert isinstance(request.error, dict), request.error
    assert request.error["type"] == "service_unavailable", request.error


def test_kill_9_of_a_rank_with_restart(default_model, tmp_path):
    # --resume-timeout 0: the request in flight is not continued on the restarted group
    # (what a continued one sees: tests/orchestrator/test_resume_e2e.py)
    engine = Engine(default_model, tmp_path / "run", nproc=2,
                    launcher_args=["--restart", "1", "--resume-timeout", "0"])
    try:
        old = engine.pids()
        request = start_long_request(engine)
        os.kill(old["rank 1"], signal.SIGKILL)
        statuses = poll_until_healthy(engine.url, timeout_s=60)
        request.wait_ended()
        assert_unavailable_event(request)

        # during the restart: 503 + retry-after, on /health and on the API
        assert any(s == (503, True) for s in statuses["/health"]), statuses
        assert any(s == (503, True) for s in statuses["/v1/models"]), statuses
        (restarting,) = engine.events("engine_restarting")
        assert restarting["attempt"] == 1
        assert f"rank 1 (pid {old['rank 1']}) killed by SIGKILL" in restarting["cause"]
        (failed,) = engine.events("engine_failed")
        assert failed["ranks"] == [1] and failed["cause"] == "died"
        assert f"rank 1 (pid {old['rank 1']}) died during step" in failed["error"]

        # the new group serves, its pids are in engine.json, and its state agrees
        out = complete(engine.url, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                       ignore_eos=True)
        assert len(out["choices"][0]["token_ids"]) == 4
        new = engine.pids()
        assert new["shim"] == old["shim"] and new["rank 1"] != old["rank 1"]
        assert engine.events("engine_reconnected")
        status, text = engine.inspect("check")
        assert status == 0, text
    finally:
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]


def poll_until_healthy(url: str, timeout_s: float) -> dict[str, list[tuple[int, bool]]]:
    """(status, has retry-after) of /health and /v1/models, every 50 ms, from now until
    /health answers 200 after having answered something else."""
    seen: dict[str, list[tuple[int, bool]]] = {"/health": [], "/v1/models": []}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            for path, results in seen.items():
                r = client.get(path)
                results.append((r.status_code, "retry-after" in r.headers))
            health = seen["/health"]
            if health[-1][0] == 200 and any(s != 200 for s, _ in health):
                return seen
            time.sleep(0.05)
    raise TimeoutError(f"not healthy again within {timeout_s:g}s: {seen['/health'][-5:]}")


def test_a_hung_rank_is_named_and_stops_the_engine(default_model, tmp_path):
    """Rank 1 sleeps inside step 10 (rank 0 then waits for it in a collective): after
    --step-timeout the scheduler names rank 1 as hung, and everything stops."""
    engine = Engine(default_model, tmp_path / "run", "--step-timeout", "3", nproc=2,
                    env=with_faults(DEEPINFER_FAULT_STALL="1:10:60"))
    pids = engine.pids()
    request = start_long_request(engine)
    code = engine.proc.wait(timeout=40)
    request.wait_ended()
    assert_unavailable_event(request)
    assert code != 0
    (failed,) = engine.events("engine_failed")
    assert failed["error"] == ("rank 1 did not answer step 10 within 3s: hung "
                               "(rank 0 waiting in a collective)")
    assert (failed["ranks"], failed["cause"]) == ([1], "hung")
    engine.stop()
    assert_all_gone(engine, pids)


def test_kill_9_of_a_rank_without_restart_stops_the_engine(default_model, tmp_path):
    engine = Engine(default_model, tmp_path / "run", nproc=2)
    pids = engine.pids()
    request = start_long_request(engine)
    os.kill(pids["rank 1"], signal.SIGKILL)
    code = engine.proc.wait(timeout=30)
    request.wait_ended()
    assert_unavailable_event(request)
    assert code != 0
    exits = engine.events("child_exited")
    assert exits[0]["process"] == "rank 1" and "SIGKILL" in exits[0]["status"]
    (failed,) = engine.events("engine_failed")
    assert failed["error"].startswith(f"rank 1 (pid {pids['rank 1']}) died during step")
    engine.stop()
    assert_all_gone(engine, pids)


def assert_all_gone(engine: Engine, pids: dict[str, int]) -> None:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in pids.items() if alive(p)], "processes left behind"
    assert not engine.run_dir.exists()

