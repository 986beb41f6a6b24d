"""Why a prompt missed (cache/miss_reasons.py) and the memory of dropped hashes it reads
(cache/eviction_memory.py), through the real KVCacheManager and its tiers."""

from __future__ import annotations

import numpy as np

from cache import BlockHashChain, CacheConfig, KVCacheManager, make_extra_key
from cache.eviction_memory import MIN_ENTRIES, WAYS, EvictionMemory
from cache.miss_reasons import PreviousPrompt
from wire.client import UncachedTokens

BS = 4
KEY = make_extra_key("m", None)
OTHER = make_extra_key("m", "another-salt")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def mgr(clock: Clock | None = None, **kw) -> KVCacheManager:
    cfg = dict(block_size=BS, num_device_blocks=16)
    cfg.update(kw)
    return KVCacheManager(CacheConfig(**cfg), clock or Clock())


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def previous(tokens: list[int], key: bytes = KEY) -> PreviousPrompt:
    chain = BlockHashChain(BS, key)
    chain.extend(tokens)
    return PreviousPrompt(np.asarray(tokens, dtype=np.int64), chain)


def admit(m: KVCacheManager, seq_id: int, tokens: list[int], step: int, key: bytes = KEY,
          previous: PreviousPrompt | None = None) -> UncachedTokens:
    """`run`, checking that the reasons cover exactly the tokens not served."""
    assert m.allocate(seq_id, tokens, len(tokens), key, previous=previous) is not None
    uncached = m.uncached_tokens(seq_id)
    assert uncached is not None
    assert uncached.num_tokens == len(tokens) - m.num_cached_tokens(seq_id).num_tokens
    m.commit(seq_id, tokens, len(tokens), step)
    m.take_ops()
    m.free(seq_id, step + 1)
    m.check_invariants()
    return uncached


# --- the memory of drops --------------------------------------------------------------


def test_the_memory_keeps_the_last_drop_of_each_hash() -> None:
    clock = Clock()
    mem = EvictionMemory(0, clock)
    assert mem.num_entries == MIN_ENTRIES
    lo = np.array([5, 6, 7], dtype=np.uint64) << np.uint64(40)
    mem.add("device", lo, "admission")
    clock.t = 130.0
    mem.add("host", lo[:1], "write_back")  # the same hash again: its record moves on
    entries = mem.find(np.concatenate([lo, np.array([99], dtype=np.uint64)]))
    assert entries[3] == -1  # never dropped
    first, second = mem.drop(int(entries[0])), mem.drop(int(entries[1]))
    assert (first.tier, first.time, first.cause) == ("host", 130.0, "write_back")
    assert (second.tier, second.time, second.cause) == ("device", 100.0, "admission")


def test_a_full_set_forgets_its_oldest_drop_first() -> None:
    mem = EvictionMemory(0, Clock())
    # WAYS + 2 hashes of one set (the same low word modulo the sets, other high words),
    # the first WAYS in one batch and the last two one by one
    lo = np.uint64(3) + np.uint64(mem.num_sets) * np.arange(1, WAYS + 3, dtype=np.uint64) \
        * np.uint64(1 << 33)
    assert len(set((lo % np.uint64(mem.num_sets)).tolist())) == 1
    mem.add("device", lo[:WAYS], "growth")
    mem.add("device", lo[WAYS:WAYS + 1], "growth")
    mem.add("device", lo[WAYS + 1:], "growth")
    assert (mem.find(lo) >= 0).tolist() == [False, False] + [True] * WAYS
    # a batch larger than the set (numpy's path, past a few) keeps its last WAYS
    many = np.uint64(3) + np.uint64(mem.num_sets) * np.arange(20, 32, dtype=np.uint64) \
        * np.uint64(1 << 33)
    mem.add("host", many, "write_through")
    assert (mem.find(many) >= 0).tolist() == [False] * 8 + [True] * WAYS
    assert not (mem.find(lo) >= 0).any()
    assert {mem.drop(int(e)).cause for e in mem.find(many[8:])} == {"write_through"}


def test_a_batch_and_the_same_drops_one_by_one_fill_the_same_entries() -> None:
    clock = Clock()
    batched, single = EvictionMemory(0, clock), EvictionMemory(0, clock)
    lo = np.random.default_rng(1).integers(0, 2**63, 300, dtype=np.uint64)
    for chunk in np.split(lo, [100, 250]):
        batched.add("disk", chunk, "disk_write")
        for word in chunk:
            single.add("disk", np.array([word], dtype=np.uint64), "disk_write")
    assert np.array_equal(batched.find(lo), single.find(lo))
    assert (batched.find(lo) >= 0).all()


def test_the_memory_is_bounded_by_the_tiers_capacity() -> None:
    m = mgr(num_device_blocks=5000, num_host_blocks=3000)
    mem = m.misses.memory
    assert 8000 <= mem.num_entries < 8000 + WAYS
    assert mem.nbytes() <= 10 * mem.num_entries  # a tag, a float32 time, a code; set heads
    for i in range(50):  # 50,000 drops into 8,000 entries: it never grows
        mem.add("device", np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint64) * np.uint64(
            0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFF), "growth")
    assert mem.nbytes() <= 10 * mem.num_entries and mem.num_drops == 50_000


# --- the reasons ----------------------------------------------------------------------


def test_a_new_prompt_is_new_but_its_last_block_and_token() -> None:
    m = mgr()
    u = admit(m, 1, prompt(18), 0)  # 4 full blocks and 2 tokens: 4 cacheable blocks
    assert u == UncachedTokens(new=16, block_remainder=2)
    assert u.main_reason == "new"
    # the same prompt again: every full block but the one holding the last token hits
    u = admit(m, 2, prompt(16), 2)
    assert u == UncachedTokens(block_remainder=4) and u.main_reason == "block_remainder"
    assert m.stats.num_uncached_new_tokens == 16
    assert m.stats.num_uncached_block_remainder_tokens == 6
    assert (m.stats.num_queried_tokens - m.stats.num_device_hit_tokens
            == sum(getattr(m.stats, f"num_uncached_{r}_tokens") for r in u.by_reason()))


def test_evicted_from_the_device_tier_names_the_tier_its_age_and_cause() -> None:
    clock = Clock()
    m = mgr(clock, num_device_blocks=6)
    p = prompt(17)  # 4 full blocks
    admit(m, 1, p, 0)
    clock.t += 42.0
    admit(m, 2, prompt(21, start=500), 2)  # 6 blocks: every one of p's is reused
    clock.t += 8.0
    u = admit(m, 3, p + [9, 9, 9], 4)
    assert (u.evicted, u.block_remainder, u.new) == (16, 4, 0)
    assert (u.evicted_tier, u.evicted_age_s, u.evicted_by) == ("device", 8.0, "admission")
    assert u.main_reason == "evicted"


def test_evicted_from_the_host_tier_after_a_write_back() -> None:
    clock = Clock()
    m = mgr(clock, num_device_blocks=4, num_host_blocks=2, write_policy="write_back")
    p = prompt(9)  # 2 full blocks
    admit(m, 1, p, 0)
    admit(m, 2, prompt(13, start=100), 2)  # p's blocks go to the host
    assert m.lookup(p, KEY).num_host_tokens == 8
    clock.t += 5.0
    admit(m, 3, prompt(13, start=200), 4)  # those push p's out of the host
    clock.t += 1.0
    u = admit(m, 4, p, 6)
    assert (u.evicted, u.block_remainder) == (8, 1)
    assert (u.evicted_tier, u.evicted_age_s, u.evicted_by) == ("host", 1.0, "write_back")


def test_blocks_still_cached_past_an_evicted_one_count_as_evicted() -> None:
    m = mgr(num_device_blocks=5)
    p = prompt(17)  # 4 full blocks and a partial one (freed)
    admit(m, 1, p, 0)
    chain = BlockHashChain(BS, KEY)
    chain.extend(p)
    blocks = m.device.index.find(*chain.keys())
    m.device.lru.push(blocks[1:])  # used since: the head block is the oldest
    admit(m, 2, prompt(5, start=300), 2)  # 2 blocks: the free one, and the head evicted
    assert (m.device.index.find(*chain.keys()) >= 0).tolist() == [False, True, True, True]
    u = admit(m, 3, p, 4)
    # the chain breaks at its head: the 3 blocks still cached after it are lost with it
    assert (u.evicted, u.block_remainder, u.no_room) == (16, 1, 0)
    assert (u.evicted_tier, u.evicted_by) == ("device", "admission")


def test_a_reset_is_remembered_as_the_cause() -> None:
    m = mgr()
    p = prompt(9)
    admit(m, 1, p, 0)
    assert m.reset_prefix_cache() == 2
    u = admit(m, 2, p, 2)
    assert (u.evicted, u.evicted_tier, u.evicted_by) == (8, "device", "reset")


def test_without_prefix_caching_there_is_no_reason() -> None:
    m = mgr(enable_prefix_caching=False)
    assert m.allocate(1, prompt(9), 9, KEY) is not None
    assert m.uncached_tokens(1) is None
    assert m.stats.num_uncached_new_tokens == 0


def test_a_readmission_is_not_a_new_miss() -> None:
    m = mgr()
    assert m.allocate(1, prompt(9), 9, KEY, count_hit=False) is not None
    assert m.uncached_tokens(1) is None and m.stats.num_uncached_new_tokens == 0


def test_a_new_prompt_is_not_hashed_past_its_first_unknown_block() -> None:
    m = mgr(num_device_blocks=1100)
    long = prompt(4000)  # 999 cacheable blocks, none known
    chain = BlockHashChain(BS, KEY)
    assert m.allocate(1, long, len(long), KEY, chain) is not None
    assert m.uncached_tokens(1) == UncachedTokens(new=3996, block_remainder=4)
    assert chain.num_blocks <= 256  # what the match hashed; the rest waits for commit


# --- by the session's previous sequence -----------------------------------------------


def test_an_edited_history_diverges_where_it_was_edited() -> None:
    m = mgr(num_device_blocks=32)
    first = prompt(40)  # 10 blocks
    admit(m, 1, first, 0)
    edited = list(first)
    edited[21] = 999  # in block 5
    u = admit(m, 2, edited + prompt(10, start=300), 2, previous=previous(first + [7, 7]))
    # blocks 0-4 hit; 5-10 (to token 44) held the previous sequence's 42 tokens: edited;
    # block 11 (tokens 44-48) is new; 2 tokens of remainder
    assert (u.diverged, u.new, u.block_remainder, u.diverged_at) == (24, 4, 2, 21)
    assert u.main_reason == "diverged"


def test_a_turn_that_extends_the_previous_prompt_is_new() -> None:
    m = mgr(num_device_blocks=32)
    first = prompt(18)
    admit(m, 1, first, 0)
    u = admit(m, 2, first + [7, 7] + prompt(12, start=300), 2,
              previous=previous(first + [7, 7]))
    # blocks 0-3 hit; block 4 (the previous prompt's tail and output, never a full block)
    # and the new turn are new
    assert (u.new, u.block_remainder, u.diverged, u.diverged_at) == (12, 4, 0, -1)


def test_a_much_shorter_prompt_after_a_long_history_is_a_compaction() -> None:
    m = mgr(num_device_blocks=64)
    history = prompt(8) + prompt(120, start=100)  # system prompt, then a long history
    admit(m, 1, history, 0)
    summary = prompt(8) + prompt(30, start=700)
    u = admit(m, 2, summary, 2, previous=previous(history + [7, 7]))
    assert (u.compaction, u.block_remainder, u.diverged_at) == (28, 2, 8)
    assert u.main_reason == "compaction"


def test_the_same_tokens_cached_under_another_salt() -> None:
    m = mgr(num_device_blocks=32)
    p = prompt(21)
    admit(m, 1, p, 0, key=OTHER)
    u = admit(m, 2, p + [5], 2, previous=previous(p + [7], key=OTHER))
    assert (u.salt, u.block_remainder, u.new) == (20, 2, 0)
    # not cached under the other salt any more: nothing to share, so new
    m.reset_prefix_cache()
    u = admit(m, 3, prompt(21, start=50), 4, previous=previous(prompt(21, start=50), OTHER))
    assert (u.salt, u.new) == (0, 20)


def test_disk_hit_without_a_host_slot_to_land_in_is_no_room() -> None:
    m = mgr(num_device_blocks=8, num_host_blocks=3, num_disk_blocks=8, num_ranks=1,
            write_policy="write_through")
    p, q = prompt(13), prompt(13, start=100)  # 3 full blocks each
    admit(m, 1, p, 0)
    writes = m.take_ops().disk_write  # written through: host, then disk
    admit(m, 2, q, 2)
    writes += m.take_ops().disk_write
    m.report_disk_writes(0, [w[0] for w in writes], [])
    assert m.disk.num_committed == 6 and m.host.num_cached == 3  # q's: p's were pushed out
    m.device.drop_cached()
    # q's host hit pins every host slot this step: p's disk blocks have nowhere to land
    assert m.allocate(3, q, 13, KEY) is not None
    assert m.num_cached_tokens(3).num_host_tokens == 12
    assert m.allocate(4, p, 13, KEY) is not None
    u = m.uncached_tokens(4)
    assert (u.no_room, u.block_remainder) == (12, 1) and u.main_reason == "no_room"


def test_a_disk_record_that_failed_its_check_is_evicted_by_bad_read() -> None:
    m = mgr(num_device_blocks=8, num_host_blocks=2, num_disk_blocks=8, num_ranks=1,
            write_policy="write_through")
    p = prompt(9)
    admit(m, 1, p, 0)
    m.report_disk_writes(0, [w[0] for w in m.take_ops().disk_write], [])
    m.device.drop_cached()
    m.host.drop_cached()
    assert m.allocate(2, p, 9, KEY) is None  # reads started
    reads = [op[0] for op in m.take_ops().disk_read]
    m.report_disk_writes(0, [], [], reads[1:], reads[:1])  # the head block is bad
    assert m.allocate(2, p, 9, KEY) is not None
    u = m.uncached_tokens(2)
    assert (u.evicted, u.evicted_tier, u.evicted_by) == (8, "disk", "bad_read")
