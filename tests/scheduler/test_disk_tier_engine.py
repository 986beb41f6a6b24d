"""The disk tier inside the engine: KV goes device -> host -> disk -> host -> device
bit-identical, greedy output is token-identical, a restart on the same directory is warm,
damage and another identity are never served."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import structlog
import torch

from cache.hashing import BlockHashChain, make_extra_key
from scheduler.main import IDLE_POLL_MS, SchedulerServer
from tests.scheduler.engine_harness import inprocess_engine, run_until_done, zmq_engine
from wire.client import GenerateRequest
from wire.lifecycle import EngineInfo
from worker.disk_store import record_bytes

BS = 16
BLOCK_BYTES_TINY = 8 * 2 * 16 * 4 * 64 * 4  # layers * K/V * block * kv heads * head_dim * fp32


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def disk_engine(model, disk_dir: Path, world_size: int = 1, **kw):
    """Few device blocks and a small host tier, so a prompt is soon only on disk."""
    cfg = dict(kv_cache_memory=24 * BLOCK_BYTES_TINY // world_size,
               host_cache_memory=12 * BLOCK_BYTES_TINY // world_size,
               kv_write_policy="write_through", disk_cache_dir=str(disk_dir),
               disk_cache_size=512 * BLOCK_BYTES_TINY // world_size)
    cfg.update(kw)
    if world_size == 1:
        return inprocess_engine(model, **cfg)
    return zmq_engine(model, world_size, **cfg)


def prompt_keys(core, prompt: list[int]):
    chain = BlockHashChain(BS, make_extra_key(core.scheduler.config.model, None))
    n = (len(prompt) - 1) // BS
    chain.extend(prompt, n)
    return chain.keys(0, n)


def device_kv(core, prompt: list[int]) -> torch.Tensor:
    """The K and V of the prompt's full blocks, wherever the device tier holds them."""
    lo, hi = prompt_keys(core, prompt)
    blocks = core.scheduler.cache.device.index.find(lo, hi)
    assert (blocks >= 0).all(), "the prompt's blocks are not all on the device"
    kv = core.executor.inner.runner.kv
    idx = torch.as_tensor(blocks, dtype=torch.long)
    return torch.stack([kv.k[:, idx], kv.v[:, idx]]).clone()


def settle_writes(core) -> None:
    """Let the disk writes land and reach the scheduler (an idle step carries them)."""
    core.executor.inner.runner.disk.store.flush()
    plan = core.scheduler.schedule()
    for r in core.executor.step(plan):
        core.scheduler.cache.report_disk_writes(r.rank, r.disk_done, r.disk_dropped,
                                                r.disk_read_done, r.disk_read_bad)


def push_out(core, rng, n: int = 4) -> None:
    """Other prompts take the device and host tiers."""
    for _ in range(n):
        run_until_done(core, [GenerateRequest(f"other{rng.random()}", tokens(rng, 300), 2)])


def test_round_trip_through_disk_is_bit_identical(default_model, tmp_path) -> None:
    core = disk_engine(default_model, tmp_path / "disk")
    rng = random.Random(7)
    prompt = tokens(rng, 150)
    req = lambda rid: GenerateRequest(rid, prompt, 12, ignore_eos=True)  # noqa: E731
    cold = run_until_done(core, [req("cold")])["cold"]
    kv_before = device_kv(core, prompt)
    settle_writes(core)
    push_out(core, rng)
    settle_writes(core)
    hit = core.scheduler.cache.lookup(prompt, make_extra_key(core.scheduler.config.model, None))
    assert hit.num_device_tokens == hit.num_host_tokens == 0 and hit.num_disk_tokens == 144
    back = run_until_done(core, [req("back")])
    assert back["back"]["tokens"] == cold["tokens"]
    assert any(p.disk_read for p in core.executor.plans), "nothing was read from disk"
    assert torch.equal(device_kv(core, prompt), kv_before)  # bit-identical KV
    stats = core.scheduler.cache.stats
    assert stats.num_disk_hit_tokens == 144 and stats.num_disk_read_blocks == 9
    core.executor.shutdown()


def test_an_idle_scheduler_steps_until_every_disk_write_is_reported(default_model,
                                                                     tmp_path) -> None:
    """A rank writes in the background and reports a write only in a step result: the
    scheduler's loop, with no request left, still steps now and then (each IDLE_POLL_MS,
    not in a spin) until every write is committed, so a served request's blocks are on the
    disk's index, and in its metrics, without waiting for the next request."""
    # a slow disk (~0.5 s a write): most of the writes land after the request's last step
    core = disk_engine(default_model, tmp_path / "disk",
                       disk_write_bytes_per_s=2 * BLOCK_BYTES_TINY)
    run_until_done(core, [GenerateRequest("r", tokens(random.Random(9), 150), 4,
                                          ignore_eos=True)])
    disk, steps = core.scheduler.cache.disk, core.scheduler.step
    assert disk.num_planned_writes >= 9  # the prompt's 9 full blocks, written through
    assert disk.num_pending > 0 and not core.has_work()  # the request is done, not its writes
    limits = core.scheduler.limits
    server = SchedulerServer(core, EngineInfo("tiny", BS, 1, limits),
                             f"ipc://{tmp_path}/requests.sock", structlog.get_logger())
    loop = threading.Thread(target=server.run)
    t0 = time.monotonic()
    loop.start()
    try:
        deadline = t0 + 30
        while disk.num_pending and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.stop()
        loop.join(timeout=30)
    waited_s = time.monotonic() - t0
    assert disk.num_pending == 0 and disk.num_committed_writes == disk.num_planned_writes
    assert core.scheduler.step - steps <= waited_s / (IDLE_POLL_MS / 1000) + 3  # no spin
    core.executor.shutdown()


def test_restart_is_warm_and_drops_damage(default_model, tmp_path) -> None:
    disk = tmp_path / "disk"
    rng = random.Random(8)
    prompt = tokens(rng, 150)
    req = lambda rid: GenerateRequest(rid, prompt, 12, ignore_eos=True)  # noqa: E731
    core = disk_engine(default_model, disk)
    cold = run_until_done(core, [req("cold")])["cold"]
    settle_writes(core)
    slots = core.scheduler.cache.disk.find(*prompt_keys(core, prompt))
    record = core.executor.inner.runner.disk.store.record_bytes
    core.executor.shutdown()

    again = disk_engine(default_model, disk)  # a restarted engine, the same directory
    # the prompt's 9 full blocks, and the 10th its output filled
    assert len(again.ready[0].disk_found) == 10 and again.ready[0].disk_torn == 0
    out = run_until_done(again, [req("warm")])["warm"]
    assert out["tokens"] == cold["tokens"] and out["cached"] == 0  # device/host: none
    assert again.scheduler.cache.stats.num_disk_hit_tokens == 144
    again.executor.shutdown()

    # a flipped byte in the prompt's 5th block: the restart drops it, the rest hits
    path = disk / "rank0.kv"
    with open(path, "r+b") as f:
        f.seek(int(slots[4]) * record + 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    third = disk_engine(default_model, disk)
    assert third.ready[0].disk_torn == 1
    hit = third.scheduler.cache.lookup(prompt, make_extra_key(third.scheduler.config.model,
                                                              None))
    assert hit.num_disk_tokens == 4 * BS  # the chain stops at the dropped block
    assert run_until_done(third, [req("after")])["after"]["tokens"] == cold["tokens"]
    third.executor.shutdown()


def test_another_dtype_ignores_the_directory(default_model, tmp_path) -> None:
    disk = tmp_path / "disk"
    rng = random.Random(9)
    prompt = tokens(rng, 150)
    core = disk_engine(default_model, disk)
    run_until_done(core, [GenerateRequest("a", prompt, 4, ignore_eos=True)])
    settle_writes(core)
    core.executor.shutdown()
    other = disk_engine(default_model, disk, dtype="bfloat16")
    assert other.ready[0].disk_identity_mismatch and other.ready[0].disk_found == []
    hit = other.scheduler.cache.lookup(prompt, make_extra_key(other.scheduler.config.model,
                                                              None))
    assert hit.num_tokens == 0
    other.executor.shutdown()


def test_the_budget_holds_under_pressure(default_model, tmp_path) -> None:
    """A disk tier of 20 blocks under many prompts: the file never outgrows it, and LRU
    eviction keeps the newest."""
    disk = tmp_path / "disk"
    core = disk_engine(default_model, disk, disk_cache_size=20 * BLOCK_BYTES_TINY + 20 * 4096)
    store = core.executor.inner.runner.disk.store
    rng = random.Random(10)
    for i in range(6):
        run_until_done(core, [GenerateRequest(f"p{i}", tokens(rng, 200), 2)])
        settle_writes(core)
        assert os.path.getsize(store.path) <= core.scheduler.config.disk_cache_size
        u = core.scheduler.cache.usage()["disk"]
        assert u["cached"] + u["used"] + u["free"] == u["capacity"] == store.num_slots
    assert core.scheduler.cache.disk.num_evictions > 0
    core.executor.shutdown()


CRASHING = r"""
import json, random, sys, time
from pathlib import Path
from tests.scheduler.engine_harness import run_until_done
from tests.scheduler.test_disk_tier_engine import disk_engine, settle_writes, tokens
from wire.client import GenerateRequest
from wire.lifecycle import EngineInfo
core = disk_engine(sys.argv[1], Path(sys.argv[2]))
rng = random.Random(12)
a, b = tokens(rng, 150), tokens(rng, 150)
out_a = run_until_done(core, [GenerateRequest("a", a, 12, ignore_eos=True)])["a"]
settle_writes(core)  # a is on disk, committed
store = core.executor.inner.runner.disk.store
store.write_pause_s = 600.0  # from now on a record stops half-written
out_b = run_until_done(core, [GenerateRequest("b", b, 12, ignore_eos=True)])["b"]
deadline = time.monotonic() + 60
while store.scan().num_torn == 0 and time.monotonic() < deadline:  # b's first record
    time.sleep(0.01)  # is half on disk
print("state", json.dumps({"a": a, "b": b, "out_a": out_a["tokens"], "out_b": out_b["tokens"]}),
      flush=True)
time.sleep(600)  # killed here, mid-write
"""


@pytest.mark.slow
def test_kill_9_during_disk_writes_then_a_restart_serves_correct_output(
        default_model, tmp_path) -> None:
    """The engine is killed with SIGKILL while a disk write is half done; restarted on the
    same directory it reports the torn block it dropped, serves the committed session
    from disk and recomputes the rest, token-identical to before the crash."""
    import json
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    disk = tmp_path / "disk"
    proc = subprocess.Popen([sys.executable, "-c", CRASHING, str(default_model), str(disk)],
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:  # the child's other output (logs) comes first
        line = next(ln for ln in proc.stdout if ln.startswith("state "))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = json.loads(line.removeprefix("state "))

    again = disk_engine(default_model, disk)
    assert again.ready[0].disk_torn >= 1  # the record cut by the kill, dropped
    assert again.stats().disk["torn_at_start"] == again.ready[0].disk_torn
    assert len(again.ready[0].disk_found) >= 10  # a's blocks, written before the kill
    key = make_extra_key(again.scheduler.config.model, None)
    assert again.scheduler.cache.lookup(before["a"], key).num_disk_tokens == 144
    out = run_until_done(again, [GenerateRequest("a", before["a"], 12, ignore_eos=True)])
    assert out["a"]["tokens"] == before["out_a"]
    assert again.scheduler.cache.stats.num_disk_hit_tokens == 144
    out = run_until_done(again, [GenerateRequest("b", before["b"], 12, ignore_eos=True)])
    assert out["b"]["tokens"] == before["out_b"]  # its torn block recomputed, not served
    again.executor.shutdown()


@pytest.mark.slow
def test_world_size_4_round_trip_and_restart(default_model, tmp_path) -> None:
    """Four gloo ranks, each with its shard on disk: a disk hit after the tiers are
    pushed out, token-identical; then a restart that finds the blocks on every rank,
    where one rank's damaged record drops that block for all ranks."""
    disk = tmp_path / "disk"
    rng = random.Random(11)
    prompt = tokens(rng, 150)
    req = lambda rid: GenerateRequest(rid, prompt, 12, ignore_eos=True)  # noqa: E731
    with disk_engine(default_model, disk, world_size=4) as core:
        cold = run_until_done(core, [req("cold")])["cold"]
        push_out(core, rng, 6)
        back = run_until_done(core, [req("back")])["back"]
        assert back["tokens"] == cold["tokens"]
        assert any(p.disk_read for p in core.executor.plans)
        assert core.scheduler.cache.stats.num_disk_hit_tokens > 0
        slots = core.scheduler.cache.disk.find(*prompt_keys(core, prompt))
    assert (slots >= 0).all()
    record = record_bytes(BLOCK_BYTES_TINY // 4)  # one KV head of four on each rank
    with open(disk / "rank2.kv", "r+b") as f:  # rank 2's shard of the prompt's 3rd block
        f.seek(int(slots[2]) * record + 777)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    with disk_engine(default_model, disk, world_size=4) as again:
        found = again.ready[0].disk_found
        assert found and all(r.disk_found == found for r in again.ready)
        assert int(slots[2]) not in {s for s, _, _ in found}
        assert again.ready[2].disk_torn >= 1
        hit = again.scheduler.cache.lookup(
            prompt, make_extra_key(again.scheduler.config.model, None))
        assert hit.num_disk_tokens == 2 * BS
        out = run_until_done(again, [req("warm")])["warm"]
        assert out["tokens"] == cold["tokens"]
