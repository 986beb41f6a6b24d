"""A rank's control thread and the scheduler's telemetry, without processes."""

from __future__ import annotations

import time
from types import SimpleNamespace

from structlog.testing import capture_logs

from scheduler.request import Sequence
from scheduler.telemetry import StepRecord, Telemetry, summarize
from wire.client import GenerateRequest, RequestOutput
from wire.control import SeqRequest, SnapshotRequest, StacksRequest
from wire.control_server import ask
from wire.digest import StateDigest, table_digest
from wire.step import NewSequence, StepPlan
from worker.block_table import BlockTables
from worker.control import RankControl


def test_rank_control_reports_its_real_tables(tmp_path):
    digest = StateDigest(8, 4)
    plan = StepPlan(0, new_seqs=[NewSequence(1, [0, 1]), NewSequence(2, [5])],
                    register=[(0, 77), (3, 78)])
    digest.apply(plan)
    tables = BlockTables()
    tables.open(1, [0, 1])
    tables.open(2, [5])
    runner = SimpleNamespace(block_tables=tables, digest=digest, device="cpu",
                             tp=SimpleNamespace(collective_since=0.0), num_state_slots=0,
                             num_host_state_slots=0, num_disk_state_slots=0)
    control = RankControl(runner, 2, 4, f"ipc://{tmp_path}/rank2.sock")
    try:
        control.applied(plan)
        snap = ask(control.server.address, SnapshotRequest(detail=True))
        assert (snap.rank, snap.step, snap.state) == (2, 0, "forward")
        assert snap.seconds_in_collective == 0.0
        assert [(s.seq_id, s.num_blocks) for s in snap.seqs] == [(1, 2), (2, 1)]
        assert snap.seqs[0].table_digest == digest.tables()[1][1]
        # block 3 holds a hash and no table uses it: cached
        assert snap.usage["device"] == {"capacity": 8, "used": 3, "cached": 1, "free": 4}
        runner.block_tables[1][1] = 6  # a table the plans never said: the digest cannot see it
        snap = ask(control.server.address, SnapshotRequest(detail=True))
        assert snap.seqs[0].table_digest == table_digest(1, [0, 6]) != digest.tables()[1][1]
        runner.tp.collective_since = time.monotonic() - 2  # blocked in an all-reduce
        assert ask(control.server.address, SnapshotRequest()).seconds_in_collective >= 2
        control.finished(digest.value)
        assert ask(control.server.address, SeqRequest(1)).block_ids == [0, 6]
        assert not ask(control.server.address, SeqRequest(9)).found
        assert "MainThread" in ask(control.server.address, StacksRequest()).threads
    finally:
        control.close()


def test_telemetry_logs_each_request_once_with_its_latencies():
    telemetry = Telemetry()
    seq = Sequence(seq_id=1, request=GenerateRequest("r1", list(range(40)), 2, session_id="s1"),
                   stop_token_ids=frozenset(), extra_key=b"")
    seq.num_device_cached = 32
    telemetry.request_added(seq)
    plan = StepPlan(0, new_seqs=[NewSequence(1, [0, 1, 2])])
    record = StepRecord(summarize(plan))
    telemetry.step_started(record)
    telemetry.step_done(record)
    seq.append_output(7)
    seq.append_output(8)
    seq.arrival -= 0.05  # arrived 50 ms ago, first token 10 ms later
    seq.first_token_time = seq.arrival + 0.01
    with capture_logs() as logs:
        telemetry.request_done(RequestOutput("r1", [8], finished=True, finish_reason="length"))
        telemetry.request_done(RequestOutput("r1", [], finished=True, finish_reason="length"))
    (done,) = [e for e in logs if e["event"] == "request_done"]
    assert done["session"] == "s1" and done["prompt_tokens"] == 40
    assert done["output_tokens"] == 2 and done["device_cached_tokens"] == 32
    assert done["ttft_s"] >= 0 and done["queue_s"] >= 0 and done["e2e_s"] >= done["ttft_s"]
    hist = telemetry.histograms()
    assert sum(hist["queue_seconds"].counts) == 1 and sum(hist["step_seconds"].counts) == 1
    assert telemetry.trace[-1].new_seqs == [1] and telemetry.recent[-1].session == "s1"
