"""KVCacheManager with a disk tier: written through from the host tier, committed only
once every rank wrote it, read back through a host slot in the background, used only
once every rank read it (cache/manager.py, disk_pool.py, disk_flow.py)."""

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

    # admission starts the reads, and waits: no blocks, no swap_in in this step
    assert m.allocate(2, p, 9, KEY) is None and m.reading(2)
    reads = m.take_ops().disk_read
    assert len(reads) == 2 and m.usage()["host"]["used"] == 2  # reserved for the reads
    m.check_invariants()
    read_ids = [op[0] for op in reads]
    m.report_disk_writes(0, [], [], read_ids)
    assert m.allocate(2, p, 9, KEY) is None  # rank 1 is still reading
    m.report_disk_writes(1, [], [], read_ids)
    assert m.allocate(2, p, 9, KEY) is not None and not m.reading(2)
    ops = m.peek_ops()
    assert not ops.disk_read and len(ops.swap_in) == 2
    # a later plan swaps in the host slots the reads filled
    assert sorted(op[2] for op in reads) == sorted(s for s, _ in ops.swap_in)
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
    assert m.allocate(2, p, 13, KEY) is None
    assert len(m.peek_ops().disk_read) == 1
    m.check_invariants()


def test_restore_makes_a_warm_start() -> None:
    m = mgr()
    p = list(range(9))
    _, ops = run_and_close(m, 1, p, 0)
    for r in (0, 1):
        m.report_disk_writes(r, [op[0] for op in ops.disk_write], [])
    found = m.disk.committed_items()
    lo, hi = m.disk.index.keys_of(found)
    fresh = mgr()  # the restarted scheduler
    fresh.restore_disk(found, lo, hi)
    assert fresh.lookup(p, KEY) == PrefixHit(0, 0, 8)
    fresh.check_invariants()
    assert np.array_equal(np.sort(fresh.disk.committed_items()), np.sort(found))


def read_back(m: KVCacheManager, seq_id: int, tokens: list[int], bad_on_rank1=()):
    """Admission of ``seq_id`` starts its reads; both ranks finish them (rank 1 finds the
    records at ``bad_on_rank1`` positions damaged); the next admission takes the hit."""
    assert m.allocate(seq_id, tokens, len(tokens), KEY) is None
    reads = [op[0] for op in m.take_ops().disk_read]
    m.report_disk_writes(0, [], [], reads)
    bad = [reads[i] for i in bad_on_rank1]
    m.report_disk_writes(1, [], [], [r for r in reads if r not in bad], bad)
    assert m.allocate(seq_id, tokens, len(tokens), KEY) is not None
    m.check_invariants()
    return reads


def on_disk(m: KVCacheManager, tokens: list[int]) -> None:
    _, ops = run_and_close(m, 1, tokens, 0)
    for r in (0, 1):
        m.report_disk_writes(r, [op[0] for op in ops.disk_write], [])
    forget_memory(m)


def test_a_read_bad_on_one_rank_is_recomputed_on_all() -> None:
    m = mgr(num_device_blocks=8, num_host_blocks=4)
    p = list(range(13))  # three full blocks
    on_disk(m, p)
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 12)
    # disk_read ops come in chain order: rank 1's copy of the middle block is damaged
    read_back(m, 2, p, bad_on_rank1=[1])
    # the hit stops before the bad block; the rest of the prompt is recomputed
    assert m.num_cached_tokens(2) == PrefixHit(0, 0, 4)
    assert m.disk.num_bad_reads == 1 and m.usage()["disk"]["cached"] == 2
    m.take_ops()
    m.check_invariants()


def test_an_abort_mid_read_frees_its_slots_once_every_rank_read() -> None:
    m = mgr(num_device_blocks=8, num_host_blocks=4)
    p = list(range(13))
    on_disk(m, p)
    assert m.allocate(2, p, 13, KEY) is None
    reads = [op[0] for op in m.take_ops().disk_read]
    m.report_disk_writes(0, [], [], reads)
    m.cancel_reads(2)  # aborted: rank 1 may still be filling the host slots
    assert m.usage()["host"]["used"] == 3 and m.disk.reading.sum() == 3
    m.check_invariants()
    m.report_disk_writes(1, [], [], reads)
    assert m.usage()["host"]["used"] == 0 and m.usage()["host"]["free"] == 4
    assert not m.disk.reading.any() and m.usage()["disk"]["cached"] == 3  # still on disk
    m.check_invariants()
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 12)


def test_a_retry_takes_its_reads_where_lookup_sees_no_room_for_them() -> None:
    """`lookup` counts a disk block only where a host slot could take it now; a waiting
    sequence's reads hold theirs already. With every host slot reserved by its reads,
    `lookup` of its prompt finds nothing, and its retry still takes all it read."""
    m = mgr(num_device_blocks=8, num_host_blocks=3)
    p = list(range(13))  # three full blocks, on disk only
    on_disk(m, p)
    assert m.allocate(2, p, 13, KEY) is None
    assert m.usage()["host"]["used"] == m.usage()["host"]["capacity"] == 3
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 0)  # no host slot left to read into
    reads = [op[0] for op in m.take_ops().disk_read]
    for r in (0, 1):
        m.report_disk_writes(r, [], [], reads)
    assert m.lookup(p, KEY) == PrefixHit(0, 0, 0)  # read, not yet taken: still reserved
    assert m.allocate(2, p, 13, KEY) is not None
    assert m.num_cached_tokens(2) == PrefixHit(0, 0, 12)
    m.check_invariants()
