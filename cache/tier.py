"""What the two tiers share (cache/block_pool.py, cache/host_pool.py): ids 0..N-1 (device
blocks or host slots), each cached one in a hash index and an LRU, the others on a free
list; and the ones this step's ops hold (busy blocks, pinned slots), which stay put."""

from __future__ import annotations

import numpy as np

from cache.free_list import FreeList
from cache.hash_index import HashIndex
from cache.retention import RetainingLru, RetentionPolicy


class Tier:
    def __init__(self, num_items: int, retention: RetentionPolicy | None = None) -> None:
        self.index = HashIndex(num_items)
        self.lru = RetainingLru(num_items, retention)  # eviction order (cache/retention.py)
        self.free = FreeList(num_items)

    def held(self) -> np.ndarray:
        """bool [num_items]: held by this step's ops (each tier says which)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return (self.index.nbytes() + self.lru.nbytes() + self.free.nbytes()
                + self.held().nbytes)

    @property
    def num_free(self) -> int:
        return self.free.count

    def drop_cached(self) -> np.ndarray:
        """Forget every cached entry except those held this step; they become free.
        Returns the low hash words of those forgotten."""
        ids = np.flatnonzero(self.lru.present).astype(np.int32)
        ids = ids[~self.held()[ids]]
        self.lru.remove(ids)
        self.lru.clear(ids)
        lo = self.index.keys_of(ids)[0]
        self.index.remove(ids)
        self.free.push(ids)
        return lo

    def preload(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Mark free entries as cached under these hashes (absent, distinct): for tools and
        restores, when the KV is known to be there. Returns the ids taken."""
        assert len(lo) <= self.free.count
        ids = self.free.pop(len(lo))
        self.index.insert(ids, lo, hi)
        self.lru.push(ids)
        return ids


class PinnedTier(Tier):
    """A tier of slots that this step's ops pin (host slots copied to or from, disk slots
    read): pinned until the ops are drained (`unpin_all`), and each pin a use."""

    def __init__(self, num_items: int, retention: RetentionPolicy | None = None) -> None:
        super().__init__(num_items, retention)
        self.pinned = np.zeros(num_items, dtype=bool)
        self.num_pinned = 0
        self._pinned: list[np.ndarray] = []

    def pin(self, slots: np.ndarray) -> None:
        """Pin for this step and mark most recently used (a hit or a fresh copy)."""
        slots = np.asarray(slots, dtype=np.int32)
        if len(slots) == 0:
            return
        new = slots[~self.pinned[slots]]
        self.pinned[new] = True
        self.num_pinned += len(new)
        self._pinned.append(new)
        self.lru.push(slots)

    def unpin_all(self) -> None:
        for slots in self._pinned:
            self.pinned[slots] = False
        self._pinned = []
        self.num_pinned = 0
