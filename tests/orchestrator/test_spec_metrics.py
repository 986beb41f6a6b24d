"""/metrics with speculative decoding: the scheduler's draft counters and acceptance-length
histogram (scheduler/speculation.py SpecStats) as Prometheus text."""

from __future__ import annotations

from orchestrator.shim.metrics import Metrics
from scheduler.speculation import SpecStats
from wire.client import EngineStats


def test_spec_counters_and_histogram_render():
    spec = SpecStats()
    for drafts, kept in [(4, 4), (4, 0), (2, 1), (4, 4)]:
        spec.record(drafts, kept)
    stats = EngineStats(step=5, num_waiting=0, num_running=0, num_prefill_tokens=0,
                        num_decode_tokens=0, step_seconds=0.0, kv_bytes_per_block=1,
                        cache={}, usage={},
                        histograms={"spec_accepted_drafts": spec.histogram(4)},
                        num_spec_draft_tokens=spec.num_draft_tokens,
                        num_spec_accepted_tokens=spec.num_accepted_tokens)
    text = Metrics().render(stats).decode()
    assert "deepinfer_spec_draft_tokens_total 14.0" in text
    assert "deepinfer_spec_accepted_tokens_total 9.0" in text
    # cumulative: <= 0 kept once, <= 1 twice, <= 4 four times
    assert 'deepinfer_spec_acceptance_length_bucket{le="0.0"} 1.0' in text
    assert 'deepinfer_spec_acceptance_length_bucket{le="1.0"} 2.0' in text
    assert 'deepinfer_spec_acceptance_length_bucket{le="4.0"} 4.0' in text
    assert "deepinfer_spec_acceptance_length_count 4.0" in text
    assert "deepinfer_spec_acceptance_length_sum 9.0" in text
