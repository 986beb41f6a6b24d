"""`deepinfer-inspect cache`: why the recent requests' prompts missed, from a real
scheduler's telemetry through its control socket (no ranks)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from scheduler.control import SchedulerControl
from scheduler.telemetry import Telemetry
from tests.scheduler.test_miss_reasons_scheduler import HISTORY, Clock, make, serve
from tools.inspection.client import EngineAddresses
from tools.inspector import cmd_cache
from wire.control_server import control_address


def test_the_cache_view_says_why_recent_prompts_missed(tmp_path):
    clock = Clock()
    sched, telemetry = make(num_blocks=20, clock=clock), Telemetry()
    serve(sched, "first", HISTORY, session="s", telemetry=telemetry)
    edited = list(HISTORY)
    edited[100] = 999
    serve(sched, "edited", edited, session="s", telemetry=telemetry)
    for i in range(2):
        serve(sched, f"other{i}", list(range(300 + 150 * i, 450 + 150 * i)), telemetry=telemetry)
    clock.t += 90
    serve(sched, "evicted", HISTORY, session="s", telemetry=telemetry)
    control = SchedulerControl(sched, telemetry, control_address(tmp_path, "scheduler"))
    try:
        engine = EngineAddresses(tmp_path, control.server.address, {})
        data, tables, status = cmd_cache(engine, SimpleNamespace(last=100, timeout=5.0))
    finally:
        control.close()
    assert status == 0
    records = list(telemetry.recent)
    for reason in ("new", "diverged", "evicted", "block_remainder"):
        assert data["uncached"][reason] == sum(getattr(r.uncached, reason) for r in records) > 0
    assert data["uncached_requests"] == {"evicted": 1, "diverged": 1, "compaction": 0,
                                         "salt": 0, "no_room": 0, "no_state": 0,
                                         "new": 3,
                                         "block_remainder": 0}
    console = Console(file=io.StringIO(), width=200, record=True)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert "computed prompt tokens by reason, last 5 requests" in text
    assert "left the previous prompt at token 100" in text
    assert "first evicted from device" in text and "(admission)" in text
