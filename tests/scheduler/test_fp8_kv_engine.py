"""FP8 KV (--kv-cache-dtype) inside the engine. A token's FP8 bytes and scale depend on
its own K and V alone, and every tier copy moves a block's scales with its bytes, so a
prefix read back from any tier is the bytes the cold run wrote: at temperature 0 the
warm path gives the cold path's tokens, token for token -- a device-tier hit, a host-tier
swap out and back, a disk-tier restart -- at world size 1 in this process and 2 over
ZeroMQ. The tiny model in float32, as the harnesses run it; the byte budgets hold about
3.8 times the float32 blocks (a 64-byte head and its 4-byte scale, against 256 bytes)."""

from __future__ import annotations

import random

import pytest
import torch

from cache.hashing import make_extra_key
from tests.scheduler.engine_harness import inprocess_engine, run_until_done, zmq_engine
from tests.scheduler.test_disk_tier_engine import prompt_keys, settle_writes, tokens
from wire.client import GenerateRequest
from worker.kv_quant import FP8_DTYPES

BS = 16
# layers * K/V * block * kv heads * (head_dim FP8 bytes + a float32 scale)
FP8_BLOCK_BYTES_TINY = 8 * 2 * 16 * 4 * (64 + 4)
F32_BLOCK_BYTES_TINY = 8 * 2 * 16 * 4 * 64 * 4
MAX_MODEL_LEN = 384


def fp8_engine(model, kv: str, world_size: int = 1, disk_dir=None, device_blocks: int = 24,
               host_blocks: int = 256, **kw):
    """Budgets in FP8 blocks (per rank: each of 2 ranks holds half the KV heads)."""
    cfg = dict(kv_cache_dtype=kv, max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=device_blocks * FP8_BLOCK_BYTES_TINY // world_size,
               host_cache_memory=host_blocks * FP8_BLOCK_BYTES_TINY // world_size)
    if disk_dir is not None:
        cfg |= dict(kv_write_policy="write_through", disk_cache_dir=str(disk_dir),
                    disk_cache_size=512 * FP8_BLOCK_BYTES_TINY // world_size)
    cfg |= kw
    if world_size == 1:
        return inprocess_engine(model, **cfg)
    return zmq_engine(model, world_size, **cfg)


def device_blocks_of(core, prompt: list[int]) -> torch.Tensor:
    lo, hi = prompt_keys(core, prompt)
    blocks = core.scheduler.cache.device.index.find(lo, hi)
    assert (blocks >= 0).all(), "the prompt's blocks are not all on the device"
    return torch.as_tensor(blocks, dtype=torch.long)


def stored(core, prompt: list[int]) -> list[torch.Tensor]:
    """The prompt's full blocks as the device tier holds them: K and V bytes, scales."""
    kv, idx = core.executor.inner.runner.kv, device_blocks_of(core, prompt)
    return [kv.k[:, idx].view(torch.uint8).clone(), kv.v[:, idx].view(torch.uint8).clone(),
            kv.k_scale[:, idx].clone(), kv.v_scale[:, idx].clone()]


def push_out(core, rng, n: int = 4) -> None:
    """Other prompts take the device tier (and, with a small host tier, the host tier)."""
    for _ in range(n):
        run_until_done(core, [GenerateRequest(f"other{rng.random()}", tokens(rng, 300), 2)])


def request(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, prompt, 12, ignore_eos=True)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_cold_device_hit_and_host_hit_give_the_same_tokens(default_model, kv):
    core = fp8_engine(default_model, kv)
    runner = core.executor.inner.runner
    assert runner.kv.k.dtype == FP8_DTYPES[kv] and runner.kv.k_scale is not None
    assert runner.num_device_blocks == 24 and runner.num_host_blocks == 256
    rng = random.Random(2)
    prompt = tokens(rng, 150)
    cold = run_until_done(core, [request("cold", prompt)])["cold"]
    before = stored(core, prompt)
    warm = run_until_done(core, [request("warm", prompt)])["warm"]
    assert warm["cached"] == 144 and core.scheduler.cache.stats.num_device_hit_tokens >= 144
    push_out(core, rng)
    hit = core.scheduler.cache.lookup(prompt, make_extra_key(core.scheduler.config.model, None))
    assert hit.num_device_tokens == 0 and hit.num_host_tokens == 144
    back = run_until_done(core, [request("back", prompt)])["back"]
    assert any(p.swap_in for p in core.executor.plans), "nothing was swapped back in"
    assert cold["tokens"] == warm["tokens"] == back["tokens"]
    for was, now in zip(before, stored(core, prompt)):  # values and scales, bit for bit
        assert torch.equal(was, now)


def test_fp8_budgets_hold_the_blocks_their_bytes_pay_for(default_model):
    """The same --kv-cache-memory and --host-cache-memory: 3.76x the float32 blocks."""
    budget = 96 * F32_BLOCK_BYTES_TINY
    f32 = inprocess_engine(default_model, kv_cache_memory=budget, host_cache_memory=budget,
                           max_model_len=MAX_MODEL_LEN).executor.inner.runner
    fp8 = inprocess_engine(default_model, kv_cache_memory=budget, host_cache_memory=budget,
                           max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8").executor.inner.runner
    assert (f32.num_device_blocks, f32.num_host_blocks) == (96, 96)
    assert fp8.kv_bytes_per_block == FP8_BLOCK_BYTES_TINY
    assert fp8.num_device_blocks == fp8.num_host_blocks == budget // FP8_BLOCK_BYTES_TINY == 361


def test_fp8_disk_restart_is_warm_and_token_for_token(default_model, tmp_path):
    disk = tmp_path / "disk"
    rng = random.Random(8)
    prompt = tokens(rng, 150)
    core = fp8_engine(default_model, "fp8", disk_dir=disk, host_blocks=12)
    cold = run_until_done(core, [request("cold", prompt)])["cold"]
    before = stored(core, prompt)
    settle_writes(core)
    core.executor.shutdown()

    again = fp8_engine(default_model, "fp8", disk_dir=disk, host_blocks=12)
    assert len(again.ready[0].disk_found) == 10 and again.ready[0].disk_torn == 0
    out = run_until_done(again, [request("warm", prompt)])["warm"]
    assert out["tokens"] == cold["tokens"] and out["cached"] == 0  # device/host: none
    assert again.scheduler.cache.stats.num_disk_hit_tokens == 144
    for was, now in zip(before, stored(again, prompt)):
        assert torch.equal(was, now)
    again.executor.shutdown()

    # the same directory under another KV dtype: started empty, never read
    other = fp8_engine(default_model, "fp8_e5m2", disk_dir=disk, host_blocks=12)
    assert other.ready[0].disk_identity_mismatch and other.ready[0].disk_found == []
    other.executor.shutdown()
    auto = fp8_engine(default_model, "auto", disk_dir=disk, host_blocks=12,
                      kv_cache_memory=24 * F32_BLOCK_BYTES_TINY,
                      host_cache_memory=12 * F32_BLOCK_BYTES_TINY,
                      disk_cache_size=64 * F32_BLOCK_BYTES_TINY)
    assert auto.ready[0].disk_identity_mismatch and auto.ready[0].disk_found == []
    auto.executor.shutdown()


@pytest.mark.slow
def test_fp8_at_world_size_2_hits_every_tier_token_for_token(default_model, tmp_path):
    """Two ranks, each its half of the KV heads and their scales: a device hit, a prompt
    read back from disk through the host tier, and after a restart from disk again."""
    disk = tmp_path / "disk"
    rng = random.Random(4)
    prompt = tokens(rng, 150)
    with fp8_engine(default_model, "fp8", world_size=2, disk_dir=disk, host_blocks=12) as core:
        cold = run_until_done(core, [request("cold", prompt)])["cold"]
        warm = run_until_done(core, [request("warm", prompt)])["warm"]
        assert warm["cached"] == 144
        push_out(core, rng)
        hit = core.scheduler.cache.lookup(
            prompt, make_extra_key(core.scheduler.config.model, None))
        assert hit.num_device_tokens == 0 and hit.num_disk_tokens > 0
        back = run_until_done(core, [request("back", prompt)])["back"]
        assert any(p.disk_read for p in core.executor.plans) and any(
            p.swap_in for p in core.executor.plans)
        assert cold["tokens"] == warm["tokens"] == back["tokens"]
        # the idle engine reports the last writes, so the restart finds them
        for _ in range(50):
            if not core.scheduler.cache.disk.num_pending:
                break
            core.step()
    with fp8_engine(default_model, "fp8", world_size=2, disk_dir=disk, host_blocks=12) as again:
        assert len(again.ready[0].disk_found) > 0
        out = run_until_done(again, [request("restart", prompt)])["restart"]
        assert again.scheduler.cache.stats.num_disk_hit_tokens == 144
        assert out["tokens"] == cold["tokens"]
