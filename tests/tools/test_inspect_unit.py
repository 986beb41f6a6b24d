"""The inspection pieces without an engine: wire format, digests, comparison, metrics, logs."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.shim.metrics import Metrics
from scheduler.control import SchedulerControl
from scheduler.telemetry import Telemetry
from tests.scheduler.test_hybrid_state import Ranks, drain, make
from tools.inspection.check import compare
from tools.inspection.client import EngineNotFound, find_run_dir, load_engine
from wire import codec
from wire.client import EngineStats, GenerateRequest, HistogramData, RequestOutput
from wire.control import (
    ChunkSummary,
    PlanSummary,
    PrefixBreak,
    QueuedRequest,
    RankSnapshot,
    RunningSeq,
    SchedulerSnapshot,
    SeqTable,
    SeqView,
    SnapshotRequest,
    TierRequest,
)
from wire.control_server import ControlServer, ControlUnavailable, ask, control_address
from wire.digest import StateDigest, table_digest
from wire.log import renderers
from wire.step import NewSequence, StepPlan


def _sched(step: int = 7, seqs: dict[int, list[int]] | None = None,
           tiers: dict[str, int] | None = None) -> SchedulerSnapshot:
    seqs = {1: [4, 5, 6], 2: [9]} if seqs is None else seqs
    return SchedulerSnapshot(
        pid=1, step=step, state="idle", seconds_since_step=0.1, seconds_in_step=0.0,
        expected_digest=42, max_num_seqs=4, max_num_batched_tokens=64, max_queued_requests=8,
        num_waiting=1, num_running=2,
        seqs=[SeqTable(s, len(b), table_digest(s, b)) for s, b in seqs.items()],
        running=[RunningSeq(1, "r1", "running", 40, 3, 42, 3, 32, 0, 1.5)],
        waiting=[QueuedRequest("r3", 3, 0, 0.4, 100, 0, "no_blocks")],
        pending_closes=[5],
        last_plan=PlanSummary(7, time.time(), 0.01, chunks=[ChunkSummary(1, 41, 1, True)]),
        usage={"device": {"capacity": 16, "used": 4, "cached": 2, "free": 10}},
        tier_digests=tiers or {"device": 11, "host": 0})


def _rank(rank: int, step: int = 7, seqs: dict[int, list[int]] | None = None,
          tiers: dict[str, int] | None = None, state: str = "idle") -> RankSnapshot:
    seqs = {1: [4, 5, 6], 2: [9]} if seqs is None else seqs
    return RankSnapshot(
        rank=rank, pid=10 + rank, device="cpu", world_size=4, step=step, state=state,
        seconds_since_step=0.1, seconds_in_step=0.0, digest=42,
        seqs=[SeqTable(s, len(b), table_digest(s, b)) for s, b in seqs.items()],
        usage={"device": {"capacity": 16, "used": 4, "cached": 2, "free": 10},
               "host": {"capacity": 0, "used": 0, "cached": 0, "free": 0}},
        tier_digests=tiers or {"device": 11, "host": 0})


def test_control_messages_round_trip():
    for msg in (_sched(), _rank(2), SnapshotRequest(True),
                SeqView("rank", 1, 3, True, [1, 2], 30),
                PrefixBreak("s", "r", 10, 20, "edited", 1.5)):
        assert codec.decode(codec.encode(msg)) == msg
    stats = EngineStats(3, 0, 1, 10, 2, 0.5, 64, {"num_queried_tokens": 5}, {},
                        {"step_seconds": HistogramData([0.1, 1.0], [1, 2, 0], 1.3)}, 1)
    assert codec.decode(codec.encode(stats)) == stats


def test_table_digest_is_what_the_state_digest_adds():
    d = StateDigest(64, 8)
    d.apply(StepPlan(0, new_seqs=[NewSequence(3, [0, 7, 2])], register=[(7, 99)]))
    d.add_blocks(3, [11])
    d.add_blocks(1 << 40, [5])
    tables = d.tables()
    assert tables[3] == (4, table_digest(3, [0, 7, 2, 11]))
    assert tables[1 << 40][1] == table_digest(1 << 40, np.array([5]))
    assert table_digest(3, [0, 7, 2, 12]) != tables[3][1]
    d.close(3)
    d.close(1 << 40)
    assert sum(d.tier_digests().values()) == d.value  # with no tables, the tiers are all
    assert d.tier_digests(chunk=3) == d.tier_digests()


def _fetchers(tables: dict[str, dict[int, list[int]]], tiers: dict[str, dict[str, list[int]]]):
    def fetch_seq(name, sid):
        return SeqView("x", 0, sid, True, tables[name].get(sid, []))

    def fetch_tier(name, tier, start, stop):
        return tiers[name][tier][start:stop]

    return fetch_seq, fetch_tier


def test_compare_agrees_and_names_a_corrupted_block():
    good = {1: [4, 5, 6], 2: [9]}
    bad = {1: [4, 8, 6], 2: [9]}
    ranks = {"rank 0": _rank(0), "rank 1": _rank(1, seqs=bad), "rank 2": _rank(2)}
    fetch = _fetchers({"scheduler": good, "rank 1": bad}, {})
    assert compare(_sched(), {"rank 0": _rank(0)}, True, *fetch) == []
    diffs = compare(_sched(), ranks, True, *fetch)
    assert [(d.kind, d.process, d.seq_id, d.index, d.value, d.expected) for d in diffs] == [
        ("block_table", "rank 1", 1, 1, 8, 5)]


def test_compare_tiers_live_seqs_steps_and_silence():
    sched_tier = [0, 5, 0, 7]
    rank_tier = [0, 5, 3, 7]
    ranks = {"rank 0": _rank(0, tiers={"device": 12, "host": 0}, seqs={1: [4, 5, 6]})}
    fetch = _fetchers({}, {"scheduler": {"device": sched_tier},
                           "rank 0": {"device": rank_tier}})
    ranks["rank 0"].usage["device"]["capacity"] = 4
    diffs = compare(_sched(), ranks, True, *fetch)
    kinds = {(d.kind, d.index) for d in diffs}
    assert ("tier", 2) in kinds and ("live_seqs", None) in kinds
    diffs = compare(_sched(), {"rank 0": _rank(0, step=6, state="forward"),
                               "rank 1": ControlUnavailable("no answer")}, False, *fetch)
    assert {(d.kind, d.process) for d in diffs} == {("step", "rank 0"),
                                                    ("unreachable", "rank 1")}


def test_check_compares_a_hybrid_models_state_tables_slot_by_slot(tmp_path):
    """The scheduler's control socket serves its state tables (slots, entries, contents);
    a rank whose host state table differs is named with the slot, as for a KV tier."""
    sched, ranks = make(num_blocks=40, num_state_slots=6, num_host_blocks=30,
                        num_host_state_slots=4, max_num_seqs=1, session_ttl_s=0), Ranks(30)
    for i in range(4):  # prompts that push each other's snapshots down to the host
        sched.add_request(GenerateRequest(f"r{i}", list(range(100 * i + 10, 100 * i + 90)), 2))
        drain(sched, ranks)
    control = SchedulerControl(sched, Telemetry(), control_address(tmp_path, "scheduler"))
    try:
        snap = ask(control.server.address, SnapshotRequest(detail=True), 5)
        host = ask(control.server.address, TierRequest("host_state", 0, 100), 5).hashes
    finally:
        control.close()
    assert snap.state_slots == {"state": 6, "host_state": 4}
    assert snap.state_entries == {k: len(v) for k, v in (
        ("state", ranks.mirror.state_hashes()), ("host_state", ranks.mirror.host_state_hashes()),
        ("disk_state", {}))}
    assert snap.state_entries["host_state"] > 0
    assert host == [ranks.mirror.host_state_hashes().get(s, 0) for s in range(4)]
    slot = next(s for s, h in enumerate(host) if h)
    wrong = list(host)
    wrong[slot] += 1
    rank = _rank(0, seqs={}, tiers=dict(snap.tier_digests, host_state=1))
    rank.state_slots = snap.state_slots
    fetch = _fetchers({}, {"scheduler": {"host_state": host}, "rank 0": {"host_state": wrong}})
    diffs = compare(snap, {"rank 0": rank}, True, *fetch)
    assert [(d.tier, d.index, d.value, d.expected) for d in diffs if d.kind == "tier"] == [
        ("host_state", slot, host[slot] + 1, host[slot])]


def test_control_server_answers_and_reports_errors(tmp_path):
    def handler(msg):
        if msg.detail:
            raise ValueError("boom")
        return _rank(3)

    server = ControlServer(f"ipc://{tmp_path}/c.sock", handler).start()
    try:
        assert ask(server.address, SnapshotRequest(), 5).rank == 3
        with pytest.raises(ControlUnavailable, match="boom"):
            ask(server.address, SnapshotRequest(detail=True), 5)
    finally:
        server.close()
    with pytest.raises(ControlUnavailable, match="no answer"):
        ask(f"ipc://{tmp_path}/none.sock", SnapshotRequest(), 0.2)


def test_metrics_parse_and_move():
    m = Metrics()
    reports = []
    m.reporter = reports.append
    stats = EngineStats(5, 1, 2, 100, 20, 0.5, 64, {"num_queried_tokens": 80,
                                                     "num_device_hit_tokens": 48}, {},
                        {"queue_seconds": HistogramData([0.1, 1.0], [2, 1, 0], 0.7),
                         "step_prefill_tokens": HistogramData([16.0], [3, 1], 40),
                         "step_decode_tokens": HistogramData([16.0], [4, 0], 4)}, 0)
    timer = m.track(10)
    timer.output(RequestOutput("a", [1], num_reasoning_tokens=1))
    timer.output(RequestOutput("a", [2, 3], finished=True, finish_reason="stop",
                               num_reasoning_tokens=2))
    m.count_prefix_break("sess", num_common_tokens=5, num_prompt_tokens=9)
    m.count_prefix_break()  # the shim's tracker may give no details
    families = {f.name: f for f in text_string_to_metric_families(m.render(stats).decode())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in families.values() for s in f.samples}
    assert value[("deepinfer_time_to_first_token_seconds_count", ())] == 1
    assert value[("deepinfer_inter_token_latency_seconds_count", ())] == 2
    assert value[("deepinfer_requests_total", (("finish_reason", "stop"),))] == 1
    assert value[("deepinfer_prefix_breaks_total", ())] == 2
    assert value[("deepinfer_reasoning_tokens_total", ())] == 2
    assert value[("deepinfer_request_queue_time_seconds_bucket", (("le", "1.0"),))] == 3
    assert value[("deepinfer_step_tokens_count", (("kind", "prefill"),))] == 4
    assert value[("deepinfer_rank_digest_mismatches_total", ())] == 0
    assert value[("deepinfer_prefix_cache_hit_tokens_total", (("tier", "device"),))] == 48
    assert [r.session for r in reports] == ["sess", ""]
    assert "deepinfer_state_slots" not in families, "state slots of a model that keeps none"
    stats.state_usage = {"device": {"capacity": 8, "used": 2, "cached": 5, "free": 1}}
    text = m.render(stats).decode()
    assert 'deepinfer_state_slots{state="cached",tier="device"} 5.0' in text


def test_logs_are_json_in_files_and_readable_at_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("DEEPINFER_LOG_FORMAT", raising=False)
    assert isinstance(renderers(Tty())[-1], structlog.dev.ConsoleRenderer)
    assert isinstance(renderers(io.StringIO())[-1], structlog.processors.JSONRenderer)
    monkeypatch.setenv("DEEPINFER_LOG_FORMAT", "json")
    assert isinstance(renderers(Tty())[-1], structlog.processors.JSONRenderer)


def test_engine_discovery(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPINFER_RUN_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(EngineNotFound, match="no running engine"):
        find_run_dir()
    run = tmp_path / "deepinfer-abc"
    run.mkdir()
    (run / "engine.json").write_text(json.dumps({"launcher_pid": 1 << 30, "world_size": 2}))
    with pytest.raises(EngineNotFound):
        find_run_dir()  # its launcher is gone
    import os

    (run / "engine.json").write_text(json.dumps({"launcher_pid": os.getpid(), "world_size": 2}))
    assert find_run_dir() == run
    engine = load_engine(Path(run))
    assert engine.scheduler.endswith("control-scheduler.sock")
    assert list(engine.named()) == ["scheduler", "rank 0", "rank 1"]
