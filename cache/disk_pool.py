"""The disk tier's index: which block hash each disk slot holds, owned by the scheduler.

Each rank stores its shard of a slot in its own file (worker/disk_store.py) and writes
it in the background, where a write may also be *dropped* (the rank's queue was full,
the disk failed). So a slot moves through these states:

    free --plan_write--> pending --every rank wrote it--> committed --evicted--> free
                            \\--any rank dropped it----------------------------> free
    committed --a read failed its check on some rank--> doomed --reads done--> free

Only committed slots are found (`find`) and in the LRU: a read is planned only of a slot
that every rank holds, so a write one rank could not do costs a miss, never a desync.
A committed slot with reads in flight (`begin_read`, cache/disk_reads.py) is not evicted
until they end; a read spans steps. Eviction is LRU; the budget is the slot count, fixed
at start-up.

The scheduler runs this on every step, so it works on arrays: a write's id names its slot
(``generation * num_slots + slot``), and a rank's report is a few vector ops however many
writes it carries. A pending write's key is in the hash index already (so a key is never
planned twice, with one lookup), masked out of `find` until it is committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache.eviction_memory import EvictionMemory
from cache.tier import PinnedTier

MAX_RANKS = 64  # the ranks that answered for a write are bits of a uint64


@dataclass
class PlannedWrites:
    """What `plan_writes` planned: per write, the index into the keys, its id and slot."""

    index: np.ndarray  # int64
    write_id: np.ndarray  # int64
    slot: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.slot)

    def __iter__(self):
        return zip(self.index.tolist(), self.write_id.tolist(), self.slot.tolist())

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return int(self.index[i]), int(self.write_id[i]), int(self.slot[i])


class DiskPool(PinnedTier):
    def __init__(self, num_slots: int, num_ranks: int = 1,
                 drops: EvictionMemory | None = None) -> None:
        assert num_slots >= 0 and 1 <= num_ranks <= MAX_RANKS
        super().__init__(num_slots)
        self.drops = drops  # told of every hash this tier lets go (cache/miss_reasons.py)
        self.num_slots = num_slots
        self.num_ranks = num_ranks
        self._all_ranks = np.uint64((1 << num_ranks) - 1)
        self.pending = np.zeros(num_slots, dtype=bool)
        self._write_id = np.full(num_slots, -1, dtype=np.int64)  # pending write per slot
        self._generation = np.zeros(num_slots, dtype=np.int64)
        self._reported = np.zeros(num_slots, dtype=np.uint64)  # ranks that answered
        self._dropped = np.zeros(num_slots, dtype=bool)  # some rank dropped it
        self._num_pending = 0
        self.reading = np.zeros(num_slots, dtype=np.int32)  # reads in flight per slot
        self.doomed = np.zeros(num_slots, dtype=bool)  # failed a read; freed once unread
        self.num_planned_writes = 0
        self.num_committed_writes = 0
        self.num_dropped_writes = 0  # dropped by at least one rank
        self.num_evictions = 0
        self.num_found_at_start = 0
        self.num_bad_reads = 0  # slots dropped because a read failed on some rank

    def held(self) -> np.ndarray:
        return self.pinned | self.pending | (self.reading > 0) | self.doomed

    @property
    def num_pending(self) -> int:
        return self._num_pending

    @property
    def num_committed(self) -> int:
        return self.lru.count

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Committed slot of each key, or -1 (int32)."""
        slots = self.index.find(lo, hi)
        if self._num_pending:
            slots[(slots >= 0) & self.pending[slots]] = -1
        return slots

    def committed_mask(self) -> np.ndarray:
        return self.index.registered_mask() & ~self.pending

    def committed_items(self) -> np.ndarray:
        return np.flatnonzero(self.committed_mask()).astype(np.int32)

    # --- writes ---------------------------------------------------------------------

    def plan_writes(self, lo: np.ndarray, hi: np.ndarray) -> PlannedWrites:
        """Slots for the keys not on disk yet (committed or pending): free ones first,
        then the least recently used committed ones not read. Best effort: fewer when
        every slot is pending or read. ``lo``/``hi`` come least valuable first, like the
        host tier's copies; when room runs short the most valuable (last) ones are kept."""
        lo, hi = np.asarray(lo, np.uint64), np.asarray(hi, np.uint64)
        none = PlannedWrites(np.zeros(0, np.int64), np.zeros(0, np.int64),
                             np.zeros(0, np.int32))
        if self.num_slots == 0 or len(lo) == 0:
            return none
        want = np.flatnonzero(self.index.find(lo, hi) < 0)  # neither committed nor pending
        if len(want) > 1 and len(np.unique(lo[want])) < len(want):
            # a key twice in one batch (not from the manager, whose blocks' hashes are
            # distinct): its first occurrence
            pairs = np.stack([lo[want], hi[want]], axis=1)
            _, first = np.unique(pairs, axis=0, return_index=True)
            want = want[np.sort(first)]
        if len(want) == 0:
            return none
        slots = self.free.pop(len(want))
        if len(slots) < len(want):
            busy = self.pinned | (self.reading > 0)
            evicted = self.lru.pop(len(want) - len(slots), skip=busy if busy.any() else None)
            if self.drops is not None:
                self.drops.add("disk", self.index.keys_of(evicted)[0], "disk_write")
            self.index.remove(evicted)
            self.num_evictions += len(evicted)
            slots = np.concatenate([slots, evicted]).astype(np.int32)
        want = want[len(want) - len(slots):]  # short of room: keep the most valuable
        ids = self._generation[slots] * self.num_slots + slots
        self._generation[slots] += 1
        self._write_id[slots] = ids
        self._reported[slots] = 0
        self._dropped[slots] = False
        self.pending[slots] = True
        self.index.insert(slots, lo[want], hi[want])
        self._num_pending += len(slots)
        self.num_planned_writes += len(slots)
        return PlannedWrites(want.astype(np.int64), ids, slots)

    def report(self, rank: int, done: list[int], dropped: list[int]) -> None:
        """A rank's finished writes (StepResult.disk_done / disk_dropped). Once every rank
        answered for a write: committed if none dropped it, else its slot is free again."""
        if not done and not dropped:
            return
        ids = np.asarray(list(done) + list(dropped), dtype=np.int64)
        slots = (ids % self.num_slots).astype(np.int32)
        assert (self._write_id[slots] == ids).all(), (
            f"rank {rank} reported a disk write never planned (or already settled)")
        bit = np.uint64(1 << rank)
        assert not (self._reported[slots] & bit).any(), f"rank {rank} reported a write twice"
        self._reported[slots] |= bit
        self._dropped[slots[len(done):]] = True
        fin = slots[self._reported[slots] == self._all_ranks]
        if len(fin) == 0:
            return
        self._write_id[fin] = -1
        self.pending[fin] = False
        self._num_pending -= len(fin)
        bad = self._dropped[fin]
        self.index.remove(fin[bad])
        self.free.push(fin[bad])
        self.num_dropped_writes += int(bad.sum())
        good = fin[~bad]
        self.lru.push(good)
        self.num_committed_writes += len(good)

    # --- reads ----------------------------------------------------------------------

    def pin(self, slots: np.ndarray) -> None:
        """Read by this step's ops: kept until `unpin_all`, and a use (most recent)."""
        slots = np.asarray(slots, dtype=np.int32)
        assert self.committed_mask()[slots].all(), "reading a disk slot not committed"
        super().pin(slots)

    def begin_read(self, slots: np.ndarray) -> None:
        """Reads of these committed slots start (a use: most recent); they stay until
        `end_read`, over as many steps as the reads take."""
        slots = np.asarray(slots, dtype=np.int32)
        assert self.lru.present[slots].all(), "reading a disk slot not committed"
        np.add.at(self.reading, slots, 1)
        self.lru.push(slots)

    def end_read(self, slots: np.ndarray, bad: np.ndarray) -> None:
        """Reads of ``slots`` ended on every rank; ``bad[i]``: on some rank the record
        failed its check. Such a slot leaves the index now (no new read, on any rank)
        and is free once no read of it is in flight."""
        slots = np.asarray(slots, dtype=np.int32)
        np.subtract.at(self.reading, slots, 1)
        assert (self.reading[slots] >= 0).all()
        drop = np.unique(slots[bad])
        drop = drop[self.lru.present[drop]]
        if len(drop):
            if self.drops is not None:
                self.drops.add("disk", self.index.keys_of(drop)[0], "bad_read")
            self.index.remove(drop)
            self.lru.remove(drop)
            self.doomed[drop] = True
            self.num_bad_reads += len(drop)
        ready = np.unique(slots[self.doomed[slots] & (self.reading[slots] == 0)])
        self.doomed[ready] = False
        self.free.push(ready)

    # --- start-up -------------------------------------------------------------------

    def restore(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Warm restart: these slots hold these hashes on every rank (agreed at start-up),
        committed at once. Lower slot numbers count as older."""
        slots = np.asarray(slots, dtype=np.int32)
        if len(slots) == 0:
            return
        assert self.free.count == self.num_slots, "restore into a pool in use"
        lo, hi = np.asarray(lo, np.uint64), np.asarray(hi, np.uint64)
        # A hash may be in two slots (an old copy a dropped overwrite left in place):
        # index one, leave the other free.
        keys = np.stack([lo, hi], axis=1)
        _, first = np.unique(keys, axis=0, return_index=True)
        first.sort()
        slots, lo, hi = slots[first], lo[first], hi[first]
        self.free.take(slots)
        self.index.insert(slots, lo, hi)
        self.lru.push(slots)
        self.num_found_at_start = len(slots)

    def check(self) -> None:
        free = self.free.is_free
        committed = self.committed_mask()
        states = [free, committed, self.pending, self.doomed]
        assert (sum(s.astype(np.int32) for s in states) == 1).all(), "a slot in two states"
        assert (self.lru.present == committed).all()
        assert not (self.pinned & ~committed).any()
        assert not ((self.reading > 0) & ~(committed | self.doomed)).any()
        assert not (self.doomed & (self.reading == 0)).any()
        assert not (self.pending & ~self.index.registered_mask()).any()
        assert ((self._write_id >= 0) == self.pending).all()
        assert int(self.pending.sum()) == self._num_pending
        self.lru.check()
        self.index.check()
