"""The host tier: slots in RAM holding copies of device blocks, with a hash index and LRU.

Host slots have no reference counts: sequences never point at them; a hit is copied
back to a device block (swap_in). Every slot is free, cached (registered, in the LRU),
or *reserved*: the target of a disk read in flight (cache/disk_flow.py), registered
only once every rank has read it. A slot touched by the ops of the current step -- the
target of a queued swap_out or the source of a queued swap_in -- is *pinned* until the
ops are drained:
  - a pinned swap_in source must not be overwritten first (swap_out runs before
    swap_in, so reusing it this step would load the wrong KV);
  - a pinned swap_out target must not be written twice in one batch (workers copy a
    batch with one indexed store, whose order for repeated targets is undefined).
"""

from __future__ import annotations

import numpy as np

from cache.retention import RetentionPolicy
from cache.tier import PinnedTier


class HostPool(PinnedTier):
    def __init__(self, num_slots: int, retention: RetentionPolicy | None = None) -> None:
        assert num_slots >= 0
        super().__init__(num_slots, retention)  # the LRU holds exactly the registered slots
        self.num_slots = num_slots
        self.reserved = np.zeros(num_slots, dtype=bool)
        self.num_reserved = 0

    def held(self) -> np.ndarray:
        return self.pinned | self.reserved

    def reserve(self, slots: np.ndarray) -> None:
        """Slots just taken (`take`) that a disk read fills over the next steps: neither
        free nor findable until `release` or `register`."""
        assert not self.reserved[slots].any()
        self.reserved[slots] = True
        self.num_reserved += len(slots)

    def unreserve(self, slots: np.ndarray) -> None:
        assert self.reserved[slots].all()
        self.reserved[slots] = False
        self.num_reserved -= len(slots)

    def release(self, slots: np.ndarray) -> None:
        """Reserved slots whose read failed or was abandoned: free again."""
        self.unreserve(slots)
        self.free.push(np.asarray(slots, dtype=np.int32))

    @property
    def num_cached(self) -> int:
        return self.lru.count - self.num_pinned

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return self.index.find(lo, hi)

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``k`` slots to write: free ones, then the least recently used unpinned
        ones, whose hashes leave the index. Fewer when the rest are pinned or retained: a
        copy to the host is optional, so it never costs a retained slot its TTL.

        Returns (slots, evicted, the low hash words of the evicted)."""
        got = self.free.pop(k)
        evicted = self.lru.pop(k - len(got), skip=self.pinned if self.num_pinned else None,
                               retained=False)
        self.lru.clear(evicted)
        evicted_lo = self.index.keys_of(evicted)[0]
        self.index.remove(evicted)
        return np.concatenate([got, evicted]), evicted, evicted_lo

    def register(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Index slots about to receive a swap_out this step (and pin them)."""
        self.index.insert(slots, lo, hi)
        self.pin(slots)

    def check(self) -> None:
        free = self.free.is_free
        registered = self.index.registered_mask()
        assert not (free & registered).any() and not (self.reserved & (free | registered)).any()
        assert (free | registered | self.reserved).all()
        assert self.num_reserved == int(self.reserved.sum())
        assert (self.lru.present == registered).all()
        assert not (self.pinned & ~registered).any()
        assert self.num_pinned == int(self.pinned.sum())
        assert (self.num_pinned + self.num_cached + self.num_free + self.num_reserved
                == self.num_slots)
        self.lru.check()
        self.index.check()
