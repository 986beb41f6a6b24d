"""KVCacheManager with a disk tier: written through from the host tier, committed only
once every rank wrote it, read back through a host slot (cache/manager.py, disk_pool.py)."""

from __future__ import annotations

import numpy as np

from cache import CacheConfig, KVCacheManager, PrefixHit, make_extra_key

BS = 4
KEY = make_extra_key("m", None)


def mgr(**kw) -> KVCacheManager:
    cfg = dict(block_size=BS, num_device_blocks=4, num_host_blocks=2, num_disk_blocks=8,
               num_ranks=2, write_policy="write_through")
    cfg.update(kw)
    return KVCacheManager(CacheConfig(**cfg))


def forget_memory(m: KVCacheManager) -> None:
    """The device and host tiers forget their cached blocks (as a restart would)."""
    m.device.drop_cached()
    m.host.drop_cached()


def run_and_close(m: KVCacheManager, seq_id: int, tokens: list[int], step: int):
    """One sequence: admit it whole, commit, drain that step's ops, close it next step.
    Returns the ops of both steps."""
    assert m.allocate(seq_id, tokens, len(tokens), KEY) is not None
    m.commit(seq_id, tokens, len(tokens), step)
    m.check_invariants()
    first = m.take_ops()
    m.free(seq_id, step + 1)
    m.check_invariants()
    return first, m.take_ops()


def test_write_through_then_commit_then_read_back() -> None:
    m = mgr()
    p = list(range(9))  # two full blocks and one token
    _, ops = run_and_close(m, 1, p, 0)  # write_through: the host copy comes a step later
    assert len(ops.swap_out) == 2 and len(ops.disk_write) == 2
    host_slots = {s for _, s in ops.swap_out}
    assert {op[1] for op in ops.disk_write} == host_slots
    wids = [op[0] for op in ops.disk_write]
    m.report_disk_writes(0, wids, [])
    assert m.lookup(p, KEY) == PrefixHit(8, 0, 0)  # still on the device
    forget_memory(m)  # the disk has nothing committed yet
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 0)
    m.report_disk_writes(1, wids, [])  # now every rank wrote them
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 8)
    assert m.usage()["disk"]["cached"] == 2

    assert m.allocate(2, p, 9, KEY) is not None
    ops = m.peek_ops()
    assert len(ops.disk_read) == 2 and len(ops.swap_in) == 2
    # the disk read lands in the host slot the swap_in reads
    assert [op[1] for op in ops.disk_read] == [s for s, _ in ops.swap_in]
    m.check_invariants()
    assert m.num_cached_tokens(2) == PrefixHit(0, 0, 8)
    assert m.stats.num_disk_hit_tokens == 8 and m.stats.hit_rate == 8 / 18  # 2 prompts
    m.take_ops()
    assert m.reset_prefix_cache() >= 2 and m.usage()["disk"]["cached"] == 0  # all tiers


def test_a_drop_on_one_rank_is_a_miss_for_all() -> None:
    m = mgr()
    p = list(range(9))
    _, ops = run_and_close(m, 1, p, 0)
    wids = [op[0] for op in ops.disk_write]
    m.report_disk_writes(0, wids, [])
    # written tail first (least valuable first); rank 1 dropped the tail's write
    m.report_disk_writes(1, wids[1:], wids[:1])
    forget_memory(m)
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 4)
    assert m.disk.num_dropped_writes == 1 and m.usage()["disk"]["free"] == 7


def test_a_small_host_tier_bounds_what_reaches_the_disk() -> None:
    m = mgr(num_host_blocks=1, num_device_blocks=8)
    p = list(range(13))  # three full blocks
    _, ops = run_and_close(m, 1, p, 0)
    # one host slot: only one block reached the host, and so the disk
    wids = [op[0] for op in ops.disk_write]
    for r in (0, 1):
        m.report_disk_writes(r, wids, [])
    forget_memory(m)
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 4)  # the head block (kept as most valuable)
    assert m.allocate(2, p, 13, KEY) is not None
    assert len(m.peek_ops().disk_read) == 1
    m.check_invariants()


def test_restore_makes_a_warm_start() -> None:
    m = mgr()
    p = list(range(9))
    _, ops = run_and_close(m, 1, p, 0)
    for r in (0, 1):
        m.report_disk_writes(r, [op[0] for op in ops.disk_write], [])
    found = m.disk.index.registered_items()
    lo, hi = m.disk.index.keys_of(found)
    fresh = mgr()  # the restarted scheduler
    fresh.restore_disk(found, lo, hi)
    assert fresh.lookup(p, KEY) == PrefixHit(0, 0, 8)
    fresh.check_invariants()
    assert np.array_equal(np.sort(fresh.disk.index.registered_items()), np.sort(found))
