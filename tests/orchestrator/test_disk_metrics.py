"""The disk tier's figures in /metrics (orchestrator/shim/metrics.py), and none when off."""

from __future__ import annotations

from orchestrator.shim.metrics import EngineCollector
from wire.client import EngineStats


def stats(disk: dict[str, int]) -> EngineStats:
    return EngineStats(step=3, num_waiting=0, num_running=0, num_prefill_tokens=0,
                       num_decode_tokens=0, step_seconds=0.0, kv_bytes_per_block=1000,
                       cache={"num_disk_hit_tokens": 64}, usage={}, disk=disk)


def samples(s: EngineStats) -> dict[tuple[str, tuple], float]:
    c = EngineCollector()
    c.stats = s
    return {(sm.name, tuple(sorted(sm.labels.items()))): sm.value
            for family in c.collect() for sm in family.samples}


def test_disk_metrics() -> None:
    got = samples(stats({"num_read_blocks": 4, "num_committed_writes": 9,
                         "num_dropped_writes": 2, "queue_depth": 5, "found_at_start": 7,
                         "torn_at_start": 1}))
    assert got[("deepinfer_prefix_cache_hit_tokens_total", (("tier", "disk"),))] == 64
    assert got[("deepinfer_disk_bytes_total", (("direction", "read"),))] == 4000
    assert got[("deepinfer_disk_bytes_total", (("direction", "written"),))] == 9000
    assert got[("deepinfer_disk_write_queue_depth", ())] == 5
    assert got[("deepinfer_disk_dropped_writes_total", ())] == 2
    assert got[("deepinfer_disk_blocks_found_after_restart", ())] == 7
    assert got[("deepinfer_disk_torn_blocks_dropped", ())] == 1


def test_no_disk_metrics_when_the_tier_is_off() -> None:
    assert not [k for k in samples(stats({})) if k[0].startswith("deepinfer_disk_")]
