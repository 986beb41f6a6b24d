"""The disk tier's index (cache/disk_pool.py) against simulated ranks whose writes finish,
drop, and die with a restart in any order.

Each simulated rank holds, per disk slot, the block hash really on its disk. The property
that keeps ranks in step: every committed slot holds its hash on *every* rank, so a read
planned of it is the same KV everywhere; and the pool never holds more than its slots.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.disk_pool import DiskPool

KEYS = [(k * 7919 + 1, k * 104729 + 3) for k in range(12)]


def arr(keys):
    return (np.array([k[0] for k in keys], np.uint64), np.array([k[1] for k in keys], np.uint64))


def agree(disks: list[dict[int, tuple[int, int]]]):
    """What the ranks agree on at start-up: slots holding the same hash on every rank."""
    slots = sorted(s for s in disks[0] if all(d.get(s) == disks[0][s] for d in disks))
    return slots, [disks[0][s] for s in slots]


class DiskPoolMachine(RuleBasedStateMachine):
    @initialize(num_slots=st.integers(1, 6), num_ranks=st.integers(1, 3))
    def init(self, num_slots, num_ranks) -> None:
        self.pool = DiskPool(num_slots, num_ranks)
        self.num_ranks = num_ranks
        self.disks: list[dict[int, tuple[int, int]]] = [{} for _ in range(num_ranks)]
        # per rank, writes planned and not reported yet: (write id, slot, key)
        self.queues: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(num_ranks)]

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def plan(self, keys) -> None:
        lo, hi = arr(keys)
        for i, wid, slot in self.pool.plan_writes(lo, hi):
            for q in self.queues:
                q.append((wid, slot, keys[i]))
        self.pool.unpin_all()  # the ops of the step are drained

    @rule(data=st.data(), drop=st.booleans())
    def finish(self, data, drop) -> None:
        ranks = [r for r in range(self.num_ranks) if self.queues[r]]
        if not ranks:
            return
        r = data.draw(st.sampled_from(ranks))
        wid, slot, key = self.queues[r].pop(data.draw(st.integers(0, len(self.queues[r]) - 1)))
        if drop:
            self.pool.report(r, [], [wid])
        else:
            self.disks[r][slot] = key
            self.pool.report(r, [wid], [])

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
          more=st.lists(st.sampled_from(KEYS), max_size=4))
    def read_then_write(self, keys, more) -> None:
        """Reads pin their slots for the step: a write planned in the same step never
        takes one of them."""
        lo, hi = arr(keys)
        found = self.pool.find(lo, hi)
        read = np.unique(found[found >= 0])
        self.pool.pin(read)
        if more:
            for i, wid, slot in self.pool.plan_writes(*arr(more)):
                assert slot not in read.tolist(), "a write took a slot read this step"
                for q in self.queues:
                    q.append((wid, slot, more[i]))
        self.pool.unpin_all()

    @rule(data=st.data())
    def restart(self, data) -> None:
        """Every process dies; each write still queued on a rank either made it to its
        disk or left a torn record there (gone). The new pool holds what all agree on."""
        for r, q in enumerate(self.queues):
            for _, slot, key in q:
                if data.draw(st.booleans()):
                    self.disks[r][slot] = key
                else:
                    self.disks[r].pop(slot, None)
            q.clear()
        self.pool = DiskPool(self.pool.num_slots, self.num_ranks)
        slots, keys = agree(self.disks)
        if slots:
            self.pool.restore(np.array(slots, np.int32), *arr(keys))

    @precondition(lambda self: hasattr(self, "pool"))
    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        committed = self.pool.committed_items()
        lo, hi = self.pool.index.keys_of(committed)
        for slot, a, b in zip(committed.tolist(), lo.tolist(), hi.tolist()):
            for d in self.disks:
                assert d.get(slot) == (a, b), "a committed slot missing on a rank"
        # the budget: never more slots than it has, committed and pending together
        assert self.pool.num_committed + self.pool.num_pending <= self.pool.num_slots


TestDiskPool = DiskPoolMachine.TestCase
TestDiskPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


def test_commit_waits_for_every_rank_and_a_drop_frees() -> None:
    pool = DiskPool(4, num_ranks=2)
    (_, w0, s0), (_, w1, s1) = pool.plan_writes(*arr(KEYS[:2]))
    pool.report(0, [w0, w1], [])
    assert (pool.find(*arr(KEYS[:2])) == -1).all()  # rank 1 has not written them
    pool.report(1, [w0], [w1])
    assert pool.find(*arr(KEYS[:2])).tolist() == [s0, -1]
    assert pool.num_dropped_writes == 1 and pool.free.count == 3
    # neither pending nor committed keys are written twice
    planned = pool.plan_writes(*arr(KEYS[:3]))  # KEYS[1] was dropped: written again
    assert [i for i, _, _ in planned] == [1, 2]
    w2 = planned[0][1]
    assert pool.num_pending == 2
    pool.report(0, [w2], [])
    with pytest.raises(AssertionError, match="twice"):
        pool.report(0, [w2], [])
    with pytest.raises(AssertionError, match="never planned"):
        pool.report(1, [w0], [])


def test_lru_eviction_and_budget() -> None:
    pool = DiskPool(2)
    for k in KEYS[:4]:  # one at a time, each committed: the oldest goes first
        [(_, wid, _)] = pool.plan_writes(*arr([k]))
        pool.report(0, [wid], [])
        pool.find(*arr([KEYS[0]]))
    assert (pool.find(*arr(KEYS[2:4])) >= 0).all() and (pool.find(*arr(KEYS[:2])) < 0).all()
    assert pool.num_evictions == 2 and pool.num_committed == 2
    # a use refreshes: pin (a read) KEYS[2], then a write evicts KEYS[3]
    pool.pin(pool.find(*arr([KEYS[2]])))
    pool.unpin_all()
    [(_, wid, _)] = pool.plan_writes(*arr([KEYS[5]]))
    pool.report(0, [wid], [])
    assert pool.find(*arr([KEYS[2], KEYS[3], KEYS[5]])).tolist()[1] == -1


def test_restore_keeps_one_slot_per_hash() -> None:
    pool = DiskPool(4)
    pool.restore(np.array([0, 2, 3], np.int32), *arr([KEYS[0], KEYS[1], KEYS[0]]))
    pool.check()
    assert pool.num_committed == 2 and pool.free.count == 2
    assert pool.find(*arr([KEYS[0], KEYS[1]])).tolist() == [0, 2]
