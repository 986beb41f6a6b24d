"""Overlap scheduling (scheduler/engine.py): step k+1 is planned and sent before step k's
results, and the output is the same token for token as without it -- with prefix hits,
stop tokens, max_tokens, aborts and preemption in the mix, in process and over ZeroMQ
with several ranks (rank 0 shares its samples), for the tiny and the real model."""

from __future__ import annotations

import random

import pytest

from tests.conftest import SMOLLM2, needs_smollm2
from tests.scheduler.engine_harness import inprocess_engine, zmq_engine
from tests.scheduler.test_prefix_cache_engine import BLOCK_BYTES_TINY
from wire.client import GenerateRequest

SHARED = 40  # tokens every prompt starts with: later requests hit them


def workload(seed: int, n: int = 8, vocab: int = 8000) -> list[GenerateRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(SHARED)]
    return [GenerateRequest(f"r{i}", shared + [rng.randrange(10, vocab)
                                               for _ in range(5 + 7 * i)], 6 + 3 * (i % 4))
            for i in range(n)]


def drive(core, reqs: list[GenerateRequest], abort_after: dict[str, int]) -> dict[str, dict]:
    """Submit in two waves (the second hits the first's blocks), abort some requests after
    a given number of steps, step until idle. Per request: tokens and finish reason."""
    sched = core.scheduler
    out: dict[str, dict] = {r.request_id: {"tokens": [], "reason": None} for r in reqs}
    half = len(reqs) // 2
    for r in reqs[:half]:
        sched.add_request(r)
    for n in range(10_000):
        if n == 3:
            for r in reqs[half:]:
                sched.add_request(r)
        for rid, at in abort_after.items():
            if n == at:
                o = sched.abort_request(rid)
                if o is not None:
                    out[rid]["tokens"] += o.token_ids
                    out[rid]["reason"] = o.finish_reason
        if n > 3 and not core.has_work():
            break
        if core.has_work():
            for o in core.step().outputs:
                out[o.request_id]["tokens"] += o.token_ids
                if o.finished:
                    out[o.request_id]["reason"] = o.finish_reason
    assert sched.cache.usage()["device"]["used"] == 0, "blocks leaked"
    sched.cache.check_invariants()
    check_close_timing(core.executor.plans)
    return out


def check_close_timing(plans) -> None:
    """Every sequence closes exactly once, in the plan after the last one that ran it."""
    last: dict[int, int] = {}
    closes: dict[int, list[int]] = {}
    for plan in plans:
        for sid in plan.close:
            closes.setdefault(sid, []).append(plan.step)
            assert closes[sid][-1] > last[sid]
        for chunk in plan.batch():
            last[sid := chunk.seq_id] = plan.step
    for sid, steps in closes.items():
        # a preempted sequence closes more than once; its final close follows its last run
        assert steps[-1] == last[sid] + 1, f"seq {sid}: last ran {last[sid]}, closed {steps}"
    assert set(closes) == set(last)


def both_ways(make, reqs, abort_after) -> tuple[dict, dict, list]:
    runs = {}
    for overlap in (False, True):
        core = make(overlap)
        try:
            runs[overlap] = drive(core, reqs, abort_after)
            pending = core.executor.num_pending
        finally:
            if hasattr(core, "close"):
                core.close()
    return runs[False], runs[True], pending


def assert_same(sync: dict, overlap: dict, plain: dict, aborted: set[str]) -> None:
    """Identical tokens, but for aborted requests: where an abort lands is timing (with
    overlap a new request starts a step later), so each of their runs is a prefix of what
    the request gives unaborted."""
    for rid in sync:
        if rid in aborted:
            for run in (sync, overlap):
                full = plain[rid]["tokens"]
                assert run[rid]["tokens"] == full[:len(run[rid]["tokens"])], rid
        else:
            assert sync[rid] == overlap[rid], rid


def with_stops(reqs: list[GenerateRequest], sync: dict[str, dict]) -> list[GenerateRequest]:
    """The same requests, two of them stopped by a token they generate without a stop."""
    out = []
    for i, r in enumerate(reqs):
        toks = sync[r.request_id]["tokens"]
        stop = [toks[len(toks) // 2]] if i in (1, 4) and len(toks) > 2 else []
        out.append(GenerateRequest(r.request_id, r.prompt_token_ids, r.max_tokens,
                                   stop_token_ids=stop))
    return out


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_overlap_gives_the_same_tokens_in_process(default_model, preempt):
    kv = (14 if preempt else 256) * BLOCK_BYTES_TINY

    def make(overlap):
        return inprocess_engine(default_model, kv_cache_memory=kv, max_model_len=128,
                                max_num_batched_tokens=96, async_scheduling=overlap)

    plain, _, _ = both_ways(make, workload(1), {})
    reqs = with_stops(workload(1), plain)
    sync, overlap, pending = both_ways(make, reqs, {"r2": 6, "r5": 9})
    assert_same(sync, overlap, plain, {"r2", "r5"})
    assert {v["reason"] for v in sync.values()} >= {"stop", "length", "abort"}
    # the overlapped run really planned with pending tokens
    assert sum(pending) > 0


@pytest.mark.slow
def test_overlap_gives_the_same_tokens_over_ranks(default_model):
    """World size 2 over ZeroMQ: the ranks resolve pending tokens from rank 0's broadcast,
    with preemption (a small device tier) and a host tier."""
    def make(overlap):
        ctx = zmq_engine(default_model, 2, kv_cache_memory=12 * BLOCK_BYTES_TINY,
                         host_cache_memory=64 * BLOCK_BYTES_TINY, max_model_len=128,
                         max_num_batched_tokens=96, async_scheduling=overlap)
        core = ctx.__enter__()
        core.close = lambda: ctx.__exit__(None, None, None)
        return core

    reqs = workload(2, n=6)
    plain, _, _ = both_ways(make, reqs, {})
    sync, overlap, pending = both_ways(make, with_stops(reqs, plain), {"r2": 5})
    assert_same(sync, overlap, plain, {"r2"})
    assert sum(pending) > 0


@needs_smollm2
@pytest.mark.slow
def test_overlap_gives_the_same_tokens_with_the_real_model():
    def make(overlap):
        return inprocess_engine(SMOLLM2, kv_cache_memory=24 << 20, max_model_len=256,
                                max_num_batched_tokens=128, async_scheduling=overlap)

    reqs = workload(3, n=4, vocab=49000)
    plain, _, _ = both_ways(make, reqs, {})
    sync, overlap, _ = both_ways(make, with_stops(reqs, plain), {"r2": 4})
    assert_same(sync, overlap, plain, {"r2"})


def test_max_tokens_is_never_planned_past(default_model):
    """A sequence whose pending token is its last is closed by the next plan, never run
    past it; the token still comes out as its last."""
    core = inprocess_engine(default_model, async_scheduling=True)
    req = GenerateRequest("m", list(range(20, 40)), 3)
    core.scheduler.add_request(req)
    tokens, reason = [], None
    while core.has_work():
        for o in core.step().outputs:
            tokens += o.token_ids
            reason = o.finish_reason or reason
    assert len(tokens) == 3 and reason == "length"
    ran = [p.step for p in core.executor.plans for c in p.batch()]
    closed = [p.step for p in core.executor.plans if p.close]
    assert len(ran) == 3 and closed == [ran[-1] + 1]
