"""StatePool alone (cache/state_pool.py): a hybrid model's live slots and state snapshots."""

from __future__ import annotations

import numpy as np

from cache.hashing import BlockHashChain
from cache.state_host import DEAD, HELD, RETAINED
from cache.state_pool import StatePool

BS = 4


def chain_of(tokens: list[int]) -> BlockHashChain:
    chain = BlockHashChain(BS, b"k")
    chain.extend(tokens)
    return chain


def test_a_live_slot_per_sequence_freed_for_the_plan_after_its_close():
    pool = StatePool(2)
    assert pool.open(1) == 0 and pool.open(2) == 1
    assert not pool.can_open()
    pool.close(1)
    assert not pool.can_open(), "a slot closed by this plan is reused by the next"
    assert pool.take_ops() == ([], [])
    assert pool.can_open() and pool.open(3) == 0
    pool.check()


def test_a_snapshot_is_registered_when_its_block_commits_and_hit_from_the_next_plan():
    pool = StatePool(4)
    chain = chain_of(list(range(12)))  # 3 blocks
    pool.open(1)
    snap = pool.take_snapshot(1, 2, keep=True)
    pool.commit(1, chain, 1)  # block 2 not committed yet
    assert pool.best(chain, 3) == (0, -1) and pool.peek_ops() == ([], [])
    pool.commit(1, chain, 2)
    lo = int(chain.keys(1, 2)[0][0])
    assert pool.best(chain, 3) == (0, -1), "written by this plan's forward: not yet"
    assert pool.take_ops() == ([], [(snap, lo)])
    assert pool.best(chain, 3) == (2, snap)
    assert pool.best(chain, 1) == (0, -1)  # at most the blocks asked about
    assert pool.registered() == {snap: lo}
    pool.check()


def test_a_restore_copies_the_snapshot_into_the_new_live_slot():
    pool = StatePool(3)
    chain = chain_of(list(range(8)))
    pool.open(1)
    snap = pool.take_snapshot(1, 2, keep=True)
    pool.commit(1, chain, 2)
    pool.close(1)
    pool.take_ops()
    n, slot = pool.best(chain, 2)
    pool.pin(slot)
    live = pool.open(2, restore=slot)
    assert (n, live) == (2, 0) and pool.take_ops()[0] == [(snap, live)]
    pool.check()


def test_a_pinned_snapshot_is_never_evicted():
    pool = StatePool(2)
    chain = chain_of(list(range(4)))
    pool.open(1)
    snap = pool.take_snapshot(1, 1, keep=True)
    pool.commit(1, chain, 1)
    pool.close(1)
    pool.take_ops()
    pool.pin(snap)
    assert pool.open(2) == 0
    assert not pool.can_open(), "the only other slot is pinned"
    pool.unpin(snap)
    assert pool.can_open() and pool.open(3) == snap
    assert pool.take_ops()[1] == [(snap, 0)]  # its hash leaves the digest
    pool.check()


def test_the_latest_boundary_replaces_the_one_before_unless_on_the_interval():
    pool = StatePool(5)
    chain = chain_of(list(range(20)))
    pool.open(1)
    on_interval = pool.take_snapshot(1, 2, keep=True)
    first = pool.take_snapshot(1, 3, keep=False)
    pool.commit(1, chain, 3)
    pool.take_ops()
    second = pool.take_snapshot(1, 4, keep=False)
    assert pool.take_ops()[1] == [(first, 0)]  # dropped: a later boundary has its state
    pool.commit(1, chain, 4)
    assert set(pool.registered()) == {on_interval, second}
    pool.check()


def test_a_hash_snapshotted_twice_keeps_one_slot():
    pool = StatePool(4)
    chain = chain_of(list(range(8)))
    pool.open(1)
    pool.open(2)
    a = pool.take_snapshot(1, 2, keep=True)
    b = pool.take_snapshot(2, 2, keep=True)
    pool.commit(1, chain, 2)
    pool.commit(2, chain, 2)
    assert pool.registered() == {a: int(chain.keys(1, 2)[0][0])}
    assert b not in pool.registered() and pool.num_free == 1
    pool.check()


def test_a_closed_sequences_unregistered_snapshots_are_freed():
    pool = StatePool(3)
    pool.open(1)
    pool.take_snapshot(1, 1, keep=True)
    pool.take_snapshot(1, 2, keep=True)
    pool.close(1)
    pool.take_ops()
    assert pool.num_free == 3 and pool.num_pending == 0
    pool.check()


def test_eviction_takes_a_snapshot_whose_block_is_gone_first():
    chain = chain_of(list(range(12)))
    gone = {int(chain.keys(0, 1)[0][0])}  # block 0's KV left every tier
    pool = StatePool(4, lambda lo, hi: ~np.isin(lo, list(gone)))
    pool.open(1)
    snaps = [pool.take_snapshot(1, n, keep=True) for n in (2, 1, 3)]
    pool.commit(1, chain, 3)
    pool.take_ops()
    # LRU order: 2, 1, 3 (as registered); block 1's snapshot goes first all the same
    assert pool.open(2) == snaps[1]
    pool.check()


def cached_snapshot(pool: StatePool, seq_id: int, chain: BlockHashChain, n: int) -> int:
    """Open ``seq_id``, snapshot it at block ``n``, commit, seal the plan, close it: a
    cached snapshot, hittable and evictable."""
    pool.open(seq_id)
    snap = pool.take_snapshot(seq_id, n, keep=True)
    pool.commit(seq_id, chain, n)
    pool.close(seq_id)
    pool.take_ops()
    pool.take_swaps()
    return snap


def test_an_evicted_snapshot_goes_to_the_host_and_a_hit_swaps_it_in_from_there():
    pool = StatePool(2, num_host_slots=2)
    chain = chain_of(list(range(12)))
    snap = cached_snapshot(pool, 1, chain, 2)
    lo = int(chain.keys(1, 2)[0][0])
    pool.open(2)  # the free slot
    pool.open(3)  # evicts the snapshot: demoted, its slot reused at once
    swap_out, swap_in = pool.peek_swaps()
    assert swap_out == [(snap, 0)] and swap_in == []
    assert pool.take_ops()[1] == [(snap, 0)]  # the device slot holds it no more
    assert pool.take_swaps() == ([(snap, 0)], [])
    assert pool.host.registered() == {0: lo}
    n, restore = pool.best(chain, 3)
    assert (n, restore) == (2, pool.num_slots + 0), "found on the host: a host handle"
    pool.close(2)
    pool.take_ops()
    pool.pin(restore)
    live = pool.open(4, restore)
    assert pool.take_swaps() == ([], [(0, live)]) and pool.take_ops()[0] == []
    assert pool.host.registered() == {0: lo}, "a restore copies: the host keeps it"
    pool.check()


def test_a_host_slot_a_plan_swaps_is_not_overwritten_by_that_plan():
    """The ranks run a plan's swap_outs before its swap_ins: a host slot read by a swap_in
    must not take a demotion in the same plan."""
    pool = StatePool(3, num_host_slots=1)
    a, b = chain_of(list(range(8))), chain_of(list(range(100, 108)))
    snap_a = cached_snapshot(pool, 1, a, 2)
    snap_b = cached_snapshot(pool, 2, b, 2)
    pool.open(3)  # the free slot
    pool.open(4)  # evicts a's snapshot (the oldest) to host slot 0
    assert pool.take_swaps()[0] == [(snap_a, 0)]
    pool.take_ops()
    pool.close(3)
    pool.take_ops()
    pool.take_swaps()
    _, restore = pool.best(a, 2)
    pool.pin(restore)
    live = pool.open(5, restore)  # a's state from host slot 0, into the slot 3 left
    # evicts b's snapshot: the host's one slot is read by this plan, so b's is dropped
    assert pool.take_snapshot(5, 3, keep=True) == snap_b
    swap_out, swap_in = pool.take_swaps()
    assert swap_out == [] and swap_in == [(0, live)]
    assert pool.host.registered() == {0: int(a.keys(1, 2)[0][0])}
    assert snap_b not in pool.registered()
    pool.check()


def test_a_snapshot_whose_blocks_are_gone_is_not_demoted():
    gone: set[int] = set()
    pool = StatePool(1, lambda lo, hi: ~np.isin(lo, list(gone)), num_host_slots=2)
    chain = chain_of(list(range(8)))
    cached_snapshot(pool, 1, chain, 2)
    gone.add(int(chain.keys(1, 2)[0][0]))
    pool.open(2)
    assert pool.take_swaps() == ([], []) and pool.host.num_cached == 0
    pool.check()


def test_a_running_sequences_latest_snapshot_evicted_is_not_its_own_any_more():
    """Found by the state machine: the evicted slot went on naming the sequence's latest
    snapshot, so its next boundary would have freed a slot another sequence now used."""
    pool = StatePool(2)
    chain = chain_of(list(range(8)))
    pool.open(1)
    snap = pool.take_snapshot(1, 1, keep=False)  # its latest boundary
    pool.commit(1, chain, 1)
    pool.take_ops()
    assert pool.open(2) == snap  # no free slot: the snapshot is evicted for seq 2
    pool.check()
    assert pool.take_snapshot(1, 2, keep=False) == -1  # no slot; seq 2's is left alone
    assert pool.live[2] == snap
    pool.check()



def valued(values: dict[int, int]):
    """A KV tier's answer for the hashes in ``values`` (their low words): dead, held or
    retained (KVCacheManager._chain_value)."""
    return lambda lo, hi: np.array([values[x] for x in lo.tolist()], dtype=np.int8)


def test_eviction_takes_the_least_valuable_snapshot_dead_then_held_then_retained():
    """A retained session's snapshot (its block retained by a KV tier) outlives ordinary
    ones, older or newer, as its KV does; a dead one goes before either."""
    chains = [chain_of(list(range(k, k + 8))) for k in (0, 100, 200)]
    pool = StatePool(4, valued({int(c.keys(1, 2)[0][0]): v
                                for c, v in zip(chains, (RETAINED, HELD, DEAD))}))
    snaps = [cached_snapshot(pool, q, c, 2) for q, c in enumerate(chains, 1)]  # oldest first
    pool.open(4)  # the free slot
    assert [pool.open(q) for q in (5, 6, 7)] == snaps[::-1]
    pool.check()


def test_the_host_keeps_a_retained_snapshot_over_an_older_or_newer_ordinary_one():
    for retained in (0, 1):  # the older or the newer of the two on the host
        chains = [chain_of(list(range(k, k + 8))) for k in (0, 100, 200)]
        values = [RETAINED if i == retained else HELD for i in range(3)]
        pool = StatePool(2, valued({int(c.keys(1, 2)[0][0]): v
                                    for c, v in zip(chains, values)}), num_host_slots=2)
        for q, c in enumerate(chains, 1):  # each evicts the one before down to the host
            cached_snapshot(pool, q, c, 2)
        pool.open(4)  # the free slot
        pool.open(5)  # the last snapshot goes down too: the host lets one of two go
        pool.take_ops()
        pool.take_swaps()
        assert pool.best(chains[retained], 2)[0] == 2, retained
        assert pool.best(chains[1 - retained], 2)[0] == 0, retained
        pool.check()
