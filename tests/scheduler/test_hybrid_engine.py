"""A hybrid model (linear-attention layers beside attention) in the real engine: a warm
request, restored from a state snapshot and prefilled from there, gives the same tokens
at temperature 0 as a cold one; the ranks' digests (state slots included) agree every
step; no state slot is left behind.

Skipped only while the hybrid model itself (worker/hybrid_model.py) is not in the tree:
it and `models/tiny-qwen3-5` come with it."""

from __future__ import annotations

import os
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache.hashing import BlockHashChain, make_extra_key
from orchestrator.shim.metrics import Metrics
from tests.conftest import REPO
from tests.scheduler.engine_harness import inprocess_engine, run_until_done, zmq_engine
from wire.client import GenerateRequest

pytest.importorskip("worker.hybrid_model", reason="the hybrid model is not in the tree yet")

MODEL = REPO / "models" / "tiny-qwen3-5"


def engine(**overrides):
    return inprocess_engine(str(MODEL), max_model_len=512, max_num_batched_tokens=64,
                            **overrides)


def answer(core, rid: str, prompt: list[int], n: int = 12) -> dict:
    return run_until_done(core, [GenerateRequest(rid, prompt, n, ignore_eos=True)])[rid]


def assert_clean(core) -> None:
    assert all(len({r.digest for r in step}) == 1 for step in core.executor.results)
    pool = core.scheduler.cache.state
    assert pool is not None, "the ranks reported no state slots for a hybrid model"
    assert pool.live == {} and pool.num_pending == 0
    assert pool.num_free + pool.num_cached == pool.num_slots


@pytest.mark.parametrize("interval", [1, 4])
def test_a_warm_request_answers_as_a_cold_one(interval):
    rng = random.Random(7)
    shared = [rng.randrange(10, 1000) for _ in range(150)]
    prompt = shared + [rng.randrange(10, 1000) for _ in range(37)]
    cold = answer(engine(state_snapshot_interval=interval), "cold", prompt)
    core = engine(state_snapshot_interval=interval)
    answer(core, "first", shared + [rng.randrange(10, 1000) for _ in range(20)])
    warm = answer(core, "warm", prompt)
    assert warm["cached"] > 0, "the shared prefix was not served from the cache"
    assert warm["tokens"] == cold["tokens"]
    assert_clean(core)


def test_an_agents_next_turn_goes_on_from_the_last_full_block():
    rng = random.Random(8)
    prompt = [rng.randrange(10, 1000) for _ in range(100)]
    core = engine()
    first = answer(core, "turn0", prompt)
    turn1 = prompt + first["tokens"] + [rng.randrange(10, 1000) for _ in range(30)]
    warm = answer(core, "turn1", turn1)
    bs = core.scheduler.block_size
    assert warm["cached"] == (len(prompt) + len(first["tokens"]) - 1) // bs * bs
    assert warm["tokens"] == answer(engine(), "cold", turn1)["tokens"]
    assert_clean(core)


def test_auto_snapshots_every_as_many_blocks_as_a_snapshot_is_worth():
    """`--state-snapshot-interval auto` (the default): the rank chooses 8 for this model
    in float32 (a snapshot is worth 7.1 KV blocks, worker/budget.py), reports it, and the
    scheduler snapshots there: a 150-token prompt in one chunk at 8 blocks and at its last
    (9); at 4 it would take one at 4 blocks too."""
    core = inprocess_engine(str(MODEL), max_model_len=512, max_num_batched_tokens=256)
    assert core.scheduler.config.state_snapshot_interval == 0  # auto
    assert core.ready[0].limits.state_snapshot_interval == 8
    assert core.scheduler.limits.state_snapshot_interval == 8
    answer(core, "a", list(range(10, 160)), n=2)
    snaps = [n for p in core.executor.plans for c in p.chunks for n, _ in c.state_snapshots]
    assert snaps == [128, 144]
    assert_clean(core)


STATE_BYTES = 116_736  # one state slot of models/tiny-qwen3-5 in float32
BLOCK_BYTES = 16_384  # one KV block of it


def small_device_engine(**overrides):
    """A device tier of 24 blocks and 6 snapshot slots (2 live ones), a host tier of 92
    blocks and 23 snapshots: a few prompts push a prefix and its snapshots to the host.
    The figures are a snapshot every 4 blocks' (`auto` would take 8 for this model)."""
    overrides.setdefault("state_snapshot_interval", 4)
    return inprocess_engine(str(MODEL), max_model_len=256, max_num_batched_tokens=64,
                            max_num_seqs=2, kv_cache_memory=8 * STATE_BYTES + 24 * BLOCK_BYTES,
                            host_cache_memory=4 << 20, **overrides)


def test_a_snapshot_demoted_to_the_host_and_back_answers_as_a_cold_one():
    rng = random.Random(9)
    shared = [rng.randrange(10, 1000) for _ in range(150)]
    prompt = shared + [rng.randrange(10, 1000) for _ in range(37)]
    cold = answer(small_device_engine(), "cold", prompt)
    core = small_device_engine()
    limits = core.scheduler.limits
    assert (limits.num_device_blocks, limits.num_state_slots) == (24, 8)
    assert (limits.num_host_blocks, limits.num_host_state_slots) == (92, 23)
    answer(core, "first", shared + [rng.randrange(10, 1000) for _ in range(20)])
    for i in range(3):  # other prompts take the device tier: the shared prefix goes down
        answer(core, f"other{i}", [rng.randrange(10, 1000) for _ in range(150)])
    plans = core.executor.plans
    n = len(plans)
    assert any(p.state_swap_out for p in plans), "no snapshot was demoted to the host"
    warm = answer(core, "warm", prompt)
    (admit,) = [p for p in plans[n:] if p.new_seqs]
    assert admit.state_swap_in and admit.swap_in, "the hit came back from the host tier"
    assert not admit.state_copy
    assert warm["cached"] == 128  # the snapshot at block 8 (the interval's), of 9 blocks
    assert warm["tokens"] == cold["tokens"]
    assert_clean(core)
    core.scheduler.cache.check_invariants()


def disk_engine(disk_dir, **overrides):
    """`small_device_engine` over a disk tier, written through from the host."""
    return small_device_engine(kv_write_policy="write_through", disk_cache_dir=str(disk_dir),
                               disk_cache_size=8 << 20, **overrides)


def settle_disk_writes(core) -> None:
    """Let the KV and state records land and reach the scheduler (an idle step)."""
    disk = core.executor.inner.runner.disk
    disk.store.flush()
    disk.state_store.flush()
    plan = core.scheduler.schedule()
    for r in core.executor.step(plan):
        core.scheduler.cache.report_disk_writes(r.rank, r.disk_done, r.disk_dropped)
        core.scheduler.cache.report_state_disk(r.rank, r.state_disk_done,
                                               r.state_disk_dropped, [], [])


def test_a_session_resumes_from_the_disk_tier_after_a_restart(tmp_path):
    """An agent's turn, its snapshots pushed down to the host and written through to disk;
    the engine restarts on the same directory; the next turn's hit comes from disk with
    its state, and answers as a cold run does."""
    rng = random.Random(10)
    prompt = [rng.randrange(10, 1000) for _ in range(150)]
    turn1 = prompt + [rng.randrange(10, 1000) for _ in range(37)]
    cold = answer(small_device_engine(), "cold", turn1)
    disk = tmp_path / "disk"
    core = disk_engine(disk)
    assert core.scheduler.limits.num_disk_state_slots > 0
    answer(core, "turn0", prompt)
    for i in range(3):  # other prompts take the device tier: the session goes down
        answer(core, f"other{i}", [rng.randrange(10, 1000) for _ in range(150)])
    assert any(p.state_disk_write for p in core.executor.plans), "no snapshot reached disk"
    settle_disk_writes(core)
    assert core.scheduler.cache.state.disk.pool.num_committed > 0
    assert_state_slots_in_metrics(core)
    core.executor.shutdown()

    again = disk_engine(disk)  # a restarted engine, the same directory
    assert again.ready[0].state_disk_found and again.ready[0].disk_torn == 0
    warm = answer(again, "turn1", turn1)
    (admit,) = [p for p in again.executor.plans if p.new_seqs]
    assert admit.state_swap_in and admit.swap_in, "the hit was restored from the host"
    assert any(p.state_disk_read for p in again.executor.plans), "no snapshot read from disk"
    # the snapshot at block 8 (the interval's) of the prompt's 9 full blocks: at most one
    # block is cut for want of a state
    assert again.scheduler.cache.stats.num_disk_hit_tokens == 128
    assert warm["tokens"] == cold["tokens"]
    assert_clean(again)
    again.scheduler.cache.check_invariants()
    key = chain_keys(again, prompt, 8)
    slot = int(again.scheduler.cache.state.disk.find(*key)[0])
    record = again.executor.inner.runner.disk.state_store.record_bytes
    again.executor.shutdown()

    # a flipped byte in that snapshot's record: dropped at the restart, never served
    with open(disk / "rank0.state", "r+b") as f:
        f.seek(slot * record + 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    third = disk_engine(disk)
    assert third.ready[0].disk_torn == 1
    assert third.scheduler.cache.state.disk.find(*key)[0] < 0
    assert answer(third, "turn1", turn1)["tokens"] == cold["tokens"]
    assert_clean(third)
    third.executor.shutdown()


def assert_state_slots_in_metrics(core) -> None:
    """/metrics has each tier's state slots, as the scheduler counts them, beside the
    KV blocks (deepinfer_state_slots{tier,state}, like deepinfer_kv_blocks)."""
    text = Metrics().render(core.stats()).decode()
    value = {(s.name, s.labels["tier"], s.labels["state"]): s.value
             for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "deepinfer_state_slots"}
    pool = core.scheduler.cache.state
    for tier, slots, cached in (("device", pool.num_slots, pool.num_cached),
                                ("host", pool.host.num_slots, pool.host.num_cached),
                                ("disk", pool.disk.num_slots, pool.disk.pool.num_committed)):
        got = {state: value[("deepinfer_state_slots", tier, state)]
               for state in ("used", "cached", "free", "capacity")}
        assert got["capacity"] == slots > 0 and got["cached"] == cached > 0, (tier, got)
        assert got["used"] + got["cached"] + got["free"] == slots, (tier, got)


def chain_keys(core, tokens: list[int], block: int):
    """The hash (lo, hi arrays of one) of ``tokens``' block number ``block`` (from 1)."""
    chain = BlockHashChain(core.scheduler.block_size,
                           make_extra_key(core.scheduler.config.model, None))
    chain.extend(tokens, block)
    return chain.keys(block - 1, block)


def test_an_engine_with_state_records_unreported_steps_on_until_they_are(tmp_path):
    """The scheduler's loop steps an idle engine while disk writes are unreported
    (scheduler/main.py): a snapshot's record counts as a KV block's does."""
    core = disk_engine(tmp_path / "disk")
    states = core.scheduler.cache.state.disk
    assert not core.has_unreported_writes()
    states.write_through(0, (5, 6))  # as a demotion to host state slot 0 plans it
    ((write_id, *_),) = states.write_ops
    assert core.has_unreported_writes()
    states.report(0, [write_id], [], [], [])
    assert not core.has_unreported_writes()
    core.executor.shutdown()


def test_world_size_2_a_session_resumes_from_the_disk_tier_after_a_restart(tmp_path):
    """Two gloo ranks, each with its shard of the snapshots on disk: the restart finds
    them on both ranks, and the next turn answers as a cold run."""
    rng = random.Random(12)
    prompt = [rng.randrange(10, 1000) for _ in range(150)]
    turn1 = prompt + [rng.randrange(10, 1000) for _ in range(37)]
    cold = answer(small_device_engine(), "cold", turn1)
    disk = tmp_path / "disk"
    cfg = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=2,
               kv_cache_memory=(8 * STATE_BYTES + 24 * BLOCK_BYTES) // 2,
               host_cache_memory=2 << 20, kv_write_policy="write_through",
               disk_cache_dir=str(disk), disk_cache_size=4 << 20)
    with zmq_engine(str(MODEL), 2, **cfg) as core:
        answer(core, "turn0", prompt)
        for i in range(3):
            answer(core, f"other{i}", [rng.randrange(10, 1000) for _ in range(150)])
        while core.has_unreported_writes():
            core.step()
        assert core.scheduler.cache.state.disk.pool.num_committed > 0
    with zmq_engine(str(MODEL), 2, **cfg) as again:
        found = again.ready[0].state_disk_found
        assert found and all(r.state_disk_found == found for r in again.ready)
        warm = answer(again, "turn1", turn1)
        assert any(p.state_disk_read for p in again.executor.plans)
        assert again.scheduler.cache.stats.num_disk_hit_tokens == 128
        assert warm["tokens"] == cold["tokens"]
