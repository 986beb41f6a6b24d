"""KV events across an engine restart (`deepinfer-run serve --restart 1`, one rank): the
new scheduler's first event is AllBlocksCleared at seq 0 again, so a router drops what
the last life announced and learns the new life's blocks."""

from __future__ import annotations

import os
import signal

import pytest

from orchestrator.launcher import free_port
from tests.orchestrator.e2e_helpers import complete
from tests.orchestrator.test_faults_e2e import poll_until_healthy
from tests.scheduler.kv_event_subscriber import Subscriber
from tests.tools.engine import Engine

pytestmark = pytest.mark.slow
FIRST = list(range(100, 164))  # 4 full blocks
SECOND = list(range(300, 364))


def blocks_of(prompt: list[int], sub: Subscriber) -> bool:
    held = {tuple(t) for (m, h), t in sub.stored_tokens.items() if h in sub.held[m]}
    return all(tuple(prompt[i:i + 16]) in held for i in range(0, 48, 16))


def test_a_restart_clears_what_the_router_knew(default_model, tmp_path) -> None:
    events, replay = free_port(), free_port()
    engine = Engine(default_model, tmp_path / "run", "--kv-events-endpoint", str(events),
                    "--kv-events-replay-endpoint", str(replay), nproc=1,
                    launcher_args=["--restart", "1"])
    sub = Subscriber(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
    try:
        complete(engine.url, prompt=FIRST, max_tokens=2, temperature=0)
        sub.replay(0)
        assert blocks_of(FIRST, sub) and sub.num_events["AllBlocksCleared"] == 1
        os.kill(engine.pids()["rank 0"], signal.SIGKILL)
        poll_until_healthy(engine.url, timeout_s=120)
        complete(engine.url, prompt=SECOND, max_tokens=2, temperature=0)
        # the new life counts from 0: the router asks it for everything
        sub.next_seq = 0
        sub.replay(0)
        assert sub.num_events["AllBlocksCleared"] == 2
        assert blocks_of(SECOND, sub) and not blocks_of(FIRST, sub)
    finally:
        sub.close()
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]
