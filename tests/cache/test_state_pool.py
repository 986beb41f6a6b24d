"""StatePool alone (cache/state_pool.py): a hybrid model's live slots and state snapshots."""

from __future__ import annotations

import numpy as np

from cache.hashing import BlockHashChain
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
