"""The engine at world size 4: batching changes nothing, close timing, divergence is caught."""

from __future__ import annotations

import random

import pytest

from scheduler.engine import RankDivergenceError
from tests.scheduler.engine_harness import run_until_done, zmq_engine
from tests.worker.faults import with_faults
from wire.client import GenerateRequest

pytestmark = pytest.mark.slow
LENGTHS = [3, 17, 64, 5, 130, 40, 9, 250]


def requests(prefix: str, max_tokens: int = 12) -> list[GenerateRequest]:
    rng = random.Random(7)
    return [
        GenerateRequest(f"{prefix}{i}", [rng.randrange(10, 8000) for _ in range(n)], max_tokens,
                        ignore_eos=True)
        for i, n in enumerate(LENGTHS)
    ]


def test_batching_and_chunking_change_nothing_at_world_size_4(default_model):
    with zmq_engine(default_model, 4, max_num_batched_tokens=64) as core:
        together = run_until_done(core, requests("t"))
        plans = core.executor.plans
        assert max(len(p.batch()) for p in plans) >= 4, "requests were never batched"
        assert any(len(c.token_ids) > 1 for p in plans for c in p.batch() if not c.sample), \
            "no prefill was chunked"
        core.scheduler.cache.reset_prefix_cache()
        alone = {}
        for req in requests("a"):
            alone.update(run_until_done(core, [req]))
            core.scheduler.cache.reset_prefix_cache()
    with zmq_engine(default_model, 4, max_num_batched_tokens=4096) as core:
        unchunked = run_until_done(core, requests("u"))
    # the steps through shared memory (wire/step_channel.py) instead of the socket
    with zmq_engine(default_model, 4, max_num_batched_tokens=64, step_channel="shm") as core:
        shared = run_until_done(core, requests("s"))
    for i in range(len(LENGTHS)):
        assert together[f"t{i}"]["tokens"] == alone[f"a{i}"]["tokens"], f"request {i}"
        assert together[f"t{i}"]["tokens"] == unchunked[f"u{i}"]["tokens"], f"request {i}"
        assert together[f"t{i}"]["tokens"] == shared[f"s{i}"]["tokens"], f"request {i}"
        assert len(together[f"t{i}"]["tokens"]) == 12


@pytest.mark.parametrize("overlap,channel", [(True, "zmq"), (False, "zmq"), (True, "shm")],
                         ids=["overlap", "sync", "overlap-shm"])
def test_close_comes_in_the_plan_after_the_final_token(default_model, overlap, channel):
    with zmq_engine(default_model, 4, async_scheduling=overlap, step_channel=channel) as core:
        reqs = requests("c", max_tokens=5)[:4]
        for r in reqs:
            core.scheduler.add_request(r)
        core.step()
        core.step()
        # abort one request mid-generation: it is closed by the next plan the same way
        aborted = core.scheduler.abort_request("c1")
        assert aborted.finished and aborted.finish_reason == "abort"
        done = run_until_done(core, [])
        assert all(done[f"c{i}"]["finish_reason"] == "length" for i in (0, 2, 3))
        plans = core.executor.plans
        finals: dict[int, int] = {}  # seq id -> step that sampled its final token / last ran
        for plan in plans:
            for chunk in plan.batch():
                finals[chunk.seq_id] = plan.step
        closes = {sid: p.step for p in plans for sid in p.close}
        assert set(closes) == set(finals), "every sequence is closed exactly once"
        for sid, step in closes.items():
            assert step == finals[sid] + 1, f"seq {sid}: last ran {finals[sid]}, closed {step}"
        assert core.scheduler.cache.usage()["device"]["used"] == 0, "blocks leaked"
        # the ranks returned one digest per step, all equal to the scheduler's (checked
        # by the engine every step); the last one covers the empty state
        assert len({r.digest for r in core.executor.results[-1]}) == 1


def test_divergent_rank_is_caught_with_step_and_rank(default_model):
    env = with_faults(DEEPINFER_FAULT_DIVERGE="2:3")
    with zmq_engine(default_model, 4, env=env) as core:
        with pytest.raises(RankDivergenceError, match=r"step 3.*rank 2") as err:
            run_until_done(core, requests("d", max_tokens=8)[:2])
        assert "agreeing ranks: [0, 1, 3]" in str(err.value)


def test_a_rank_that_samples_other_tokens_is_caught(default_model):
    """Under overlap every rank feeds its own samples to its next step: a rank whose
    sampler disagrees with rank 0's would run other inputs unseen by the state digest."""
    env = with_faults(DEEPINFER_FAULT_SAMPLE="1:4")
    with zmq_engine(default_model, 4, env=env) as core:
        assert core.overlap
        with pytest.raises(RankDivergenceError, match=r"ranks \[1\] sampled other tokens "
                                                      r"than rank 0 at step 4"):
            run_until_done(core, requests("s", max_tokens=8)[:2])
