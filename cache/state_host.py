"""HostStates: a hybrid model's state snapshots in the host tier (no tensors here).

A snapshot is a whole sequence's linear-attention state -- the bytes of several KV blocks
-- so the device holds few of them. One the device evicts while its block is still cached
in some KV tier is demoted to a host slot (StepPlan.state_swap_out), as a KV block is; a
prefix hit whose last snapshot is on the host restores it into the sequence's live slot
straight from there (StepPlan.state_swap_in), with no device snapshot slot between.

Every host slot is free or cached: indexed by the hash of the block its snapshot ends at,
and in an LRU unless a waiting sequence pins it as the hit it will restore. A rank reads
before it writes within a plan (swap_out, copies, then swap_in, wire/step.py), so a
snapshot demoted by a plan is hittable by that same plan; but a host slot that a plan
swaps out to or in from is *busy* until the plan is sealed (`end_plan`): a second write
to it in the same plan would land before the read.

Which host slot holds which hash is in the state digest: a swap_out gives the host slot
the device slot's hash, as for KV blocks, and an eviction is the next swap_out's overwrite.
A reset (`drop_cached`) sends nothing: the digest keeps what each slot was last told to
hold, as it does for the KV host tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

Key = tuple[int, int]  # a block hash's (lo, hi) words
# What a snapshot is worth, by the KV of the block it ends at (KVCacheManager._chain_value):
DEAD = 0  # no KV tier holds the block any more: it can never be hit
HELD = 1  # some tier holds it, as an ordinary cached (or in-use) block
RETAINED = 2  # some tier retains it (cache/retention.py): a client or session asked to keep it
# value per (lo, hi) hash, an integer array (a bool one reads as dead or held)
ChainValue = Callable[[np.ndarray, np.ndarray], np.ndarray]
# On eviction, this many of the least recently used snapshots are looked at for the least
# valuable one, so an eviction costs O(USELESS_SCAN) whatever the number of slots.
USELESS_SCAN = 32


def least_valuable(candidates: Iterable[int], key_of: dict[int, Key],
                   chain_value: ChainValue | None) -> tuple[int, bool]:
    """(slot, alive): of the first USELESS_SCAN ``candidates`` (oldest first, at least
    one), the least valuable (dead, then held, then retained: a retained session's snapshot
    outlives an ordinary one, as its KV does), the oldest of those; and whether its block
    is still held somewhere (worth keeping in a lower tier)."""
    scan = [s for s, _ in zip(candidates, range(USELESS_SCAN))]
    if chain_value is None:
        return scan[0], True
    keys = np.array([key_of[s] for s in scan], dtype=np.uint64)
    value = np.asarray(chain_value(keys[:, 0].copy(), keys[:, 1].copy())).astype(np.int8)
    i = int(np.argmin(value))  # the first of the least: the oldest in that class
    return scan[i], bool(value[i] > DEAD)


class HostStates:
    def __init__(self, num_slots: int, chain_value: ChainValue | None = None) -> None:
        self.num_slots = num_slots
        self._chain_value = chain_value
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: 0, 1, 2, ... first
        self._index: dict[Key, int] = {}
        self._key: dict[int, Key] = {}  # cached slot -> its key
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unpinned: oldest first
        self._pins: dict[int, int] = {}  # cached slot -> waiting sequences that restore it
        self._busy: set[int] = set()  # swapped out to or in from by the plan being made
        self._reading: set[int] = set()  # a disk read fills it (cache/state_disk.py)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._key)

    def find(self, key: Key) -> int:
        return self._index.get(key, -1)

    def registered(self) -> dict[int, int]:
        """Cached host slot -> its hash's lo word: what the state digest must hold."""
        return {slot: key[0] for slot, key in self._key.items()}

    def demote(self, key: Key) -> int:
        """A host slot for the snapshot of ``key`` that the device evicts now (the caller
        queues its swap_out); -1 when the host holds that key already (then it counts as
        a use) or has no slot to give (every one pinned or busy)."""
        slot = self._index.get(key)
        if slot is not None:
            if slot in self._lru:
                self._lru.move_to_end(slot)
            return -1
        slot = self._take()
        if slot >= 0:
            self._index[key] = slot
            self._key[slot] = key
            self._lru[slot] = None
            self._busy.add(slot)
        return slot

    def pin(self, slot: int) -> None:
        """A waiting sequence will restore this snapshot: not evictable until `unpin` (or
        `restore`)."""
        assert slot in self._key, f"host state slot {slot} holds no snapshot"
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._lru.pop(slot, None)

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pins

    def unpin(self, slot: int) -> None:
        unpin(self._pins, self._lru, slot)

    def restore(self, slot: int) -> None:
        """The pinned snapshot in ``slot`` is swapped into a live slot by this plan."""
        self.unpin(slot)
        self._busy.add(slot)

    def take_for_read(self) -> int:
        """A host slot a disk read fills (cache/state_disk.py): held, indexed by nothing,
        until `fill` or `release`; -1 when none can be had."""
        slot = self._take()
        if slot >= 0:
            self._reading.add(slot)
        return slot

    def fill(self, slot: int, key: Key) -> bool:
        """The read into ``slot`` is in on every rank: it holds ``key``'s snapshot now
        (most recently used). False, and the slot freed, when the host has that key in
        another slot meanwhile."""
        self._reading.remove(slot)
        if key in self._index:
            self._free.append(slot)
            return False
        self._index[key] = slot
        self._key[slot] = key
        self._lru[slot] = None
        return True

    def release(self, slot: int) -> None:
        """A read into ``slot`` failed (or its sequence left): the slot is free again."""
        self._reading.remove(slot)
        self._free.append(slot)

    def end_plan(self) -> None:
        """The plan is sealed: its swaps are in it, in the order the ranks apply them."""
        self._busy.clear()

    def drop_cached(self) -> int:
        """Forget every snapshot nobody holds (a reset of the prefix cache)."""
        victims = [s for s in self._lru if s not in self._busy]
        for slot in victims:
            self._unindex(slot)
            self._free.append(slot)
        return len(victims)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        candidates = (s for s in self._lru if s not in self._busy)
        if next((s for s in self._lru if s not in self._busy), None) is None:
            return -1
        slot, _ = least_valuable(candidates, self._key, self._chain_value)
        self._unindex(slot)
        return slot

    def _unindex(self, slot: int) -> None:
        del self._index[self._key.pop(slot)]
        self._lru.pop(slot, None)

    def check(self) -> None:
        """Every slot free or cached; the indexes agree (O(slots): tests)."""
        everything = self._free + list(self._key) + list(self._reading)
        assert sorted(everything) == list(range(self.num_slots)), (
            f"host state slots lost or doubled: free {self._free}, cached {sorted(self._key)}"
            f", read into {sorted(self._reading)}")
        assert {v: k for k, v in self._index.items()} == self._key
        assert set(self._pins) <= set(self._key) and all(n > 0 for n in self._pins.values())
        assert set(self._lru) == set(self._key) - set(self._pins)
        assert self._busy <= set(self._key)


def unpin(pins: dict[int, int], lru: dict[int, None], slot: int) -> None:
    """One pin of ``slot`` let go (the device's and the host's snapshot slots alike): the
    last one puts it back in the LRU, most recently used (a hit was just taken from it)."""
    n = pins[slot] - 1
    if n:
        pins[slot] = n
        return
    del pins[slot]
    lru[slot] = None
