"""The retention simulation, small: retention keeps the paused sessions that plain LRU
loses to the burst, with no retained block evicted early while they fit under the cap."""

from __future__ import annotations

from tools.sim.retention import RetentionScenario, run


def test_retention_keeps_paused_sessions_through_a_burst() -> None:
    sc = RetentionScenario(agents=2, session_tokens=2_000, turn_tokens=200, output_tokens=4,
                           rounds=3, burst_requests=20, burst_tokens=4_000,
                           device_tokens=40_000, host_tokens=16_000)
    lru, kept = run(sc, False, "lru"), run(sc, True, "retention")
    assert lru["returning_hit_ratio"] < 0.2
    assert kept["returning_hit_ratio"] > 0.8
    assert kept["device_retained_evictions"] == kept["host_retained_evictions"] == 0
