"""The null model end to end: the real scheduler, cache, protocol, digests and ranks over
ZeroMQ, with a forward that only waits (worker/null_model.py)."""

from __future__ import annotations

import math
import random
import time

import pytest

from tests.scheduler.engine_harness import run_until_done, zmq_engine
from wire.client import GenerateRequest
from wire.step import ScheduledChunk
from worker.distributed import TensorParallelGroup
from worker.gguf import load_config
from worker.null_model import NullModel

pytestmark = pytest.mark.slow

BLOCK_BYTES = 1024  # a null-model block of the tiny model: 8 layers, 16 tokens, float32
SHARED = list(range(100, 132))  # two blocks every prompt starts with


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [SHARED + [rng.randrange(10, 8000) for _ in range(40 + 3 * i)] for i in range(n)]


def expected(model: NullModel, prompt: list[int], max_tokens: int) -> list[int]:
    """The null model's tokens for a prompt, worked out from its rule alone."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model.token(ScheduledChunk(0, tokens[-1:], len(tokens) - 1, True)))
    return tokens[len(prompt):]


def requests(tag: str, batch: list[list[int]], max_tokens: int = 10) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", p, max_tokens) for i, p in enumerate(batch)]


@pytest.mark.parametrize("world_size,overlap,channel", [
    (1, True, "zmq"), (1, False, "zmq"), (2, True, "zmq"), (4, True, "zmq"), (4, False, "zmq"),
    (1, True, "shm"), (4, True, "shm"), (4, False, "shm")])
def test_null_model_serves_through_the_real_engine(default_model, world_size, overlap, channel):
    model = NullModel(load_config(default_model), TensorParallelGroup(0, 1), 0.0)
    first, filler = prompts(1), prompts(2)
    # A device tier of 32 blocks (6 sequences of 5-7 blocks) and a host tier behind it:
    # the filler evicts the first round's blocks to the host, the replay swaps them back.
    with zmq_engine(default_model, world_size, null_model_forward_ms=0.0, max_model_len=256,
                    kv_cache_memory=32 * BLOCK_BYTES, host_cache_memory=512 * BLOCK_BYTES,
                    max_num_batched_tokens=128, async_scheduling=overlap,
                    step_channel=channel) as core:
        runs = [run_until_done(core, requests(tag, batch))
                for tag, batch in (("a", first), ("f", filler), ("b", first))]
        stats = core.scheduler.cache.stats
        plans, results = core.executor.plans, core.executor.results
        assert core.scheduler.cache.usage()["device"]["used"] == 0, "blocks leaked"
        core.scheduler.cache.check_invariants()
    for run, batch, tag in zip(runs, (first, filler, first), "afb"):
        for i, prompt in enumerate(batch):
            assert run[f"{tag}{i}"]["tokens"] == expected(model, prompt, 10), f"{tag}{i}"
            assert run[f"{tag}{i}"]["finish_reason"] == "length"
    # the replay read its prompts from the cache, some of them from the host tier
    assert sum(runs[2][f"b{i}"]["cached"] for i in range(6)) > sum(
        runs[0][f"a{i}"]["cached"] for i in range(6))
    assert stats.num_host_hit_tokens > 0 and stats.num_swap_in_blocks > 0
    assert stats.num_swap_out_blocks > 0
    assert any(p.swap_in for p in plans) and any(p.swap_out for p in plans)
    assert max(len(p.batch()) for p in plans) >= 6, "requests were batched"
    # every rank answered every step with the scheduler's digest (checked by the engine)
    for step in results:
        assert len({r.digest for r in step}) == 1 and len(step) == world_size
        assert {r.rank for r in step} == set(range(world_size))
    # the timing every rank reports: a forward in each step with chunks, idle between
    ran = [(p, step) for p, step in zip(plans, results) if p.batch()]
    assert all(r.timing.decode_s > 0 and r.timing.apply_s > 0 for _, step in ran for r in step)
    assert sum(r.timing.gap_s for _, step in ran for r in step) > 0
    assert all(r.timing.cpu_s > 0 for _, step in ran for r in step)
    totals = core.totals.breakdown()
    assert totals["step"] > 0 and 0 < totals["idle_share"] <= 1
    # CPU time, the scheduler thread's and a rank's: one thread's never exceeds the wall's
    assert 0 < totals["sched_cpu"] <= totals["step"] and totals["rank_cpu"] > 0
    # transport is a round trip less the rank's work: without overlap only (with it, a plan
    # also waits behind the step before)
    assert totals["transport"] > 0 if not overlap else math.isnan(totals["transport"])
    assert totals["waiting"] > 0 or not overlap  # without: beyond the mean round trip


def test_null_model_forward_time_is_honoured(default_model):
    forward_ms = 20.0
    with zmq_engine(default_model, 2, null_model_forward_ms=forward_ms, max_model_len=256,
                    kv_cache_memory=64 * BLOCK_BYTES) as core:
        t0 = time.perf_counter()
        run_until_done(core, requests("t", prompts(3, n=2), max_tokens=4))
        wall = time.perf_counter() - t0
        plans, results = core.executor.plans, core.executor.results
    forwards = [r.timing.forward_s for p, step in zip(plans, results) if p.batch() for r in step]
    assert forwards and min(forwards) >= forward_ms / 1000  # lower bounds only: no flakes
    assert wall >= sum(1 for p in plans if p.batch()) * forward_ms / 1000
