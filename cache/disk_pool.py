"""The disk tier's index: which block hash each disk slot holds, owned by the scheduler.

Each rank stores its shard of a slot in its own file (worker/disk_store.py) and writes
it in the background, where a write may also be *dropped* (the rank's queue was full,
the disk failed). So a slot moves through three states:

    free --plan_write--> pending --every rank wrote it--> committed --evicted--> free
                            \\--any rank dropped it----------------------------> free

Only committed slots are in the hash index and the LRU: a read is planned only of a slot
that every rank holds, so a write one rank could not do costs a miss, never a desync.
A committed slot read by this step's ops is *pinned* until the ops are drained (not
evicted for a write planned in the same step). Eviction is LRU; the budget is the slot
count, fixed at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cache.tier import PinnedTier


@dataclass
class _PendingWrite:
    slot: int
    lo: int
    hi: int
    reported: set[int] = field(default_factory=set)  # ranks that answered for it
    dropped: bool = False


class DiskPool(PinnedTier):
    def __init__(self, num_slots: int, num_ranks: int = 1) -> None:
        assert num_slots >= 0 and num_ranks >= 1
        super().__init__(num_slots)
        self.num_slots = num_slots
        self.num_ranks = num_ranks
        self.pending = np.zeros(num_slots, dtype=bool)
        self._writes: dict[int, _PendingWrite] = {}
        self._pending_keys: dict[tuple[int, int], int] = {}  # (lo, hi) -> write id
        self._next_write_id = 0
        self.num_committed_writes = 0
        self.num_dropped_writes = 0  # dropped by at least one rank
        self.num_evictions = 0
        self.num_found_at_start = 0

    def held(self) -> np.ndarray:
        return self.pinned | self.pending

    @property
    def num_pending(self) -> int:
        return len(self._writes)

    @property
    def num_planned_writes(self) -> int:
        return self._next_write_id

    @property
    def num_committed(self) -> int:
        return self.lru.count

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Committed slot of each key, or -1 (int32)."""
        return self.index.find(lo, hi)

    # --- writes ---------------------------------------------------------------------

    def plan_writes(self, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int]]:
        """Slots for the keys not on disk yet (committed or pending): free ones first,
        then the least recently used committed ones not pinned. Best effort: fewer when
        every slot is pending or pinned. ``lo``/``hi`` come least valuable first, like the
        host tier's copies; when room runs short the most valuable (last) ones are kept.

        Returns (index into lo, write id, slot) per write planned."""
        lo, hi = np.asarray(lo, np.uint64), np.asarray(hi, np.uint64)
        if self.num_slots == 0 or len(lo) == 0:
            return []
        on_disk = self.index.find(lo, hi) >= 0
        want: list[int] = []
        seen: set[tuple[int, int]] = set()
        for i in np.flatnonzero(~on_disk).tolist():
            key = (int(lo[i]), int(hi[i]))
            if key in self._pending_keys or key in seen:
                continue
            seen.add(key)
            want.append(i)
        if not want:
            return []
        slots = self.free.pop(len(want))
        if len(slots) < len(want):
            evicted = self.lru.pop(len(want) - len(slots),
                                   skip=self.pinned if self._pinned else None)
            self.index.remove(evicted)
            self.num_evictions += len(evicted)
            slots = np.concatenate([slots, evicted])
        want = want[len(want) - len(slots):]  # short of room: keep the most valuable
        out = []
        for i, slot in zip(want, slots.tolist()):
            wid = self._next_write_id
            self._next_write_id += 1
            key = (int(lo[i]), int(hi[i]))
            self._writes[wid] = _PendingWrite(slot, *key)
            self._pending_keys[key] = wid
            self.pending[slot] = True
            out.append((i, wid, slot))
        return out

    def report(self, rank: int, done: list[int], dropped: list[int]) -> None:
        """A rank's finished writes (StepResult.disk_done / disk_dropped). Once every rank
        answered for a write: committed if none dropped it, else its slot is free again."""
        for wid, ok in [(w, True) for w in done] + [(w, False) for w in dropped]:
            w = self._writes.get(wid)
            assert w is not None, f"rank {rank} reported disk write {wid}, never planned"
            assert rank not in w.reported, f"rank {rank} reported disk write {wid} twice"
            w.reported.add(rank)
            w.dropped |= not ok
            if len(w.reported) < self.num_ranks:
                continue
            del self._writes[wid]
            del self._pending_keys[(w.lo, w.hi)]
            self.pending[w.slot] = False
            slot = np.array([w.slot], dtype=np.int32)
            if w.dropped:
                self.free.push(slot)
                self.num_dropped_writes += 1
            else:
                self.index.insert(slot, np.array([w.lo], np.uint64),
                                  np.array([w.hi], np.uint64))
                self.lru.push(slot)
                self.num_committed_writes += 1

    # --- reads ----------------------------------------------------------------------

    def pin(self, slots: np.ndarray) -> None:
        """Read by this step's ops: kept until `unpin_all`, and a use (most recent)."""
        slots = np.asarray(slots, dtype=np.int32)
        assert self.index.is_registered(slots).all(), "reading a disk slot not committed"
        super().pin(slots)

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
        committed = self.index.registered_mask()
        assert not (free & committed).any() and not (free & self.pending).any()
        assert not (committed & self.pending).any()
        assert (free | committed | self.pending).all()
        assert (self.lru.present == committed).all()
        assert not (self.pinned & ~committed).any()
        assert int(self.pending.sum()) == len(self._writes) == len(self._pending_keys)
        assert self.free.count + self.num_committed + self.num_pending == self.num_slots
        self.lru.check()
        self.index.check()
