"""A hybrid model's snapshots in the disk tier, on the scheduler's side (cache/state_disk.py):
written through from the host, committed once every rank wrote them, read back into a host
slot once every rank read them, dropped everywhere when one rank's record is bad."""

from __future__ import annotations

from cache.hashing import BlockHashChain
from cache.state_pool import StatePool

BS = 4


def chain_of(tokens: list[int]) -> BlockHashChain:
    chain = BlockHashChain(BS, b"k")
    chain.extend(tokens)
    return chain


def on_disk(ranks: int = 2) -> tuple[StatePool, BlockHashChain, tuple[int, int]]:
    """A pool whose snapshot at block 2 went device -> host -> disk (committed on every
    rank), then was let go by the host: only the disk has it."""
    pool = StatePool(2, num_host_slots=1, num_disk_slots=4, num_ranks=ranks)
    chain = chain_of(list(range(12)))
    pool.open(1)
    pool.take_snapshot(1, 2, keep=True)
    pool.commit(1, chain, 2)
    pool.close(1)
    pool.take_ops()
    pool.open(2)
    pool.open(3)  # evicts the snapshot: demoted to host slot 0, written through
    writes, reads = pool.disk.take_ops()
    key = tuple(int(k[0]) for k in chain.keys(1, 2))
    assert [(w[1], w[3], w[4]) for w in writes] == [(0, *key)] and reads == []
    for rank in range(ranks):
        assert pool.disk.pool.num_committed == 0, "committed before every rank wrote it"
        pool.disk.report(rank, [writes[0][0]], [], [], [])
    assert pool.disk.pool.num_committed == 1
    pool.take_ops()
    pool.take_swaps()
    assert pool.host.drop_cached() == 1  # the host lets it go
    assert pool.best(chain, 3) == (0, -1)
    pool.check()
    return pool, chain, key


def test_a_snapshot_read_back_from_disk_is_a_host_hit_once_every_rank_read_it():
    pool, chain, key = on_disk()
    n, slot, found = pool.on_disk(chain, 3, 0)
    assert (n, found) == (2, key)
    assert pool.on_disk(chain, 3, 2) == (0, -1, (0, 0)), "none beyond the device's"
    assert pool.disk.stage(7, slot, key)
    (read,) = pool.disk.take_ops()[1]
    pool.check()
    pool.disk.report(0, [], [], [read[0]], [])
    assert not pool.disk.settle(7), "rank 1 has not read it yet"
    pool.disk.report(1, [], [], [read[0]], [])
    assert pool.disk.settle(7) and not pool.disk.is_staged(7)
    assert pool.best(chain, 3) == (2, pool.num_slots + read[2])
    pool.check()


def test_a_record_bad_on_one_rank_is_dropped_on_every_rank():
    pool, chain, key = on_disk()
    _, slot, _ = pool.on_disk(chain, 3, 0)
    pool.disk.stage(7, slot, key)
    (read,) = pool.disk.take_ops()[1]
    pool.disk.report(0, [], [], [read[0]], [])
    pool.disk.report(1, [], [], [], [read[0]])
    assert pool.disk.settle(7)
    assert pool.best(chain, 3) == (0, -1) and pool.host.num_free == 1
    assert pool.on_disk(chain, 3, 0) == (0, -1, (0, 0)), "a bad record is never read again"
    pool.check()


def test_a_sequence_that_leaves_mid_read_frees_its_host_slot_once_the_read_is_over():
    pool, chain, key = on_disk()
    _, slot, _ = pool.on_disk(chain, 3, 0)
    pool.disk.stage(7, slot, key)
    (read,) = pool.disk.take_ops()[1]
    pool.disk.report(0, [], [], [read[0]], [])
    pool.disk.cancel(7)
    assert pool.host.num_free == 0, "rank 1 may still be filling the slot"
    pool.check()
    pool.disk.report(1, [], [], [read[0]], [])
    assert pool.host.num_free == 1 and pool.disk.pool.reading.sum() == 0
    assert pool.on_disk(chain, 3, 0)[0] == 2, "the record stays for the next hit"
    pool.check()
