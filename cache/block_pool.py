"""The device tier: reference-counted blocks, a hash index, and an LRU of cached blocks.

Every block is in exactly one state:
  used   refcount > 0 (in some sequence's block table); registered or not;
  cached refcount 0, registered (its hash is in the index): hittable, evictable, in LRU;
  free   refcount 0, unregistered, on the free list.
A cached block keeps its hash until it is actually reused (evicted): that is what keeps
a finished conversation hittable.
"""

from __future__ import annotations

import numpy as np

from cache.retention import RetentionPolicy
from cache.tier import Tier


class DevicePool(Tier):
    def __init__(self, num_blocks: int, retention: RetentionPolicy | None = None) -> None:
        assert num_blocks > 0
        super().__init__(num_blocks, retention)  # the LRU holds exactly the cached blocks
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.num_refs = 0  # refcount.sum(), kept as it changes: checked every step
        # Targets of a swap_in queued this step. Their KV arrives with this step's ops,
        # so they may be hit, but never evicted before the ops are drained: a second
        # swap_in into the same block in one batch would be applied in undefined order.
        self.busy = np.zeros(num_blocks, dtype=bool)
        self._busy: list[np.ndarray] = []

    def held(self) -> np.ndarray:
        return self.busy

    def nbytes(self) -> int:
        return self.refcount.nbytes + super().nbytes()

    @property
    def num_cached(self) -> int:
        return self.lru.count

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free.count - self.lru.count

    def num_evictable(self) -> int:
        if not self._busy:
            return self.lru.count
        busy = np.concatenate(self._busy)
        return self.lru.count - int(self.lru.present[busy].sum())

    def ref(self, blocks: np.ndarray) -> None:
        """A prefix hit: one more sequence uses these registered blocks."""
        assert self.index.is_registered(blocks).all(), "hit on an unregistered block"
        self.refcount[blocks] += 1
        self.num_refs += len(blocks)
        self.lru.remove(blocks)

    def unref(self, blocks: np.ndarray) -> None:
        """Drop one reference to each block; ``blocks[0]`` is the first to be evicted.

        Blocks reaching refcount 0 go to the LRU if registered (a use: their retention,
        if marked, runs from now), else to the free list."""
        if len(blocks) == 0:
            return
        assert (self.refcount[blocks] > 0).all(), "block released with refcount 0"
        self.refcount[blocks] -= 1
        self.num_refs -= len(blocks)
        zero = blocks[self.refcount[blocks] == 0]
        registered = self.index.is_registered(zero)
        self.lru.touch(zero[registered])
        self.lru.push(zero[registered])
        self.lru.clear(zero[~registered])
        self.free.push(zero[~registered])

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``k`` blocks for new KV, each with refcount 1: free ones first, then the least
        recently used cached ones, whose hashes leave the index.

        Returns (blocks, evicted, evicted_lo, evicted_hi); the caller checks capacity."""
        got = self.free.pop(k)
        rest = k - len(got)
        evicted = self.lru.pop(rest, skip=self.busy if self._busy else None)
        assert len(evicted) == rest, "not enough evictable blocks (check capacity first)"
        lo, hi = self.index.keys_of(evicted)
        self.index.remove(evicted)
        blocks = np.concatenate([got, evicted])
        assert (self.refcount[blocks] == 0).all(), "a referenced block was handed out"
        self.refcount[blocks] = 1
        self.num_refs += k
        return blocks, evicted, lo, hi

    def register(self, blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Index referenced blocks under their hashes (absent from the index)."""
        assert (self.refcount[blocks] > 0).all()
        self.index.insert(blocks, lo, hi)

    def mark_busy(self, blocks: np.ndarray) -> None:
        if len(blocks):
            self.busy[blocks] = True
            self._busy.append(blocks)

    def clear_busy(self) -> None:
        for blocks in self._busy:
            self.busy[blocks] = False
        self._busy = []

    def check(self) -> None:
        rc = self.refcount
        free = self.free.is_free
        cached = self.lru.present
        registered = self.index.registered_mask()
        assert (rc >= 0).all()
        assert not (free & cached).any()
        assert self.free.count == int(free.sum())
        assert (rc[free] == 0).all() and not registered[free].any()
        assert (rc[cached] == 0).all() and registered[cached].all()
        assert ((rc > 0) == ~(free | cached)).all()
        assert self.num_used + self.num_cached + self.num_free == self.num_blocks
        assert self.num_refs == int(rc.sum())
        self.lru.check()
        self.index.check()
