"""Operations both tiers share: each holds a hash index, an LRU of cached entries and a
free list over the same ids (device blocks or host slots)."""

from __future__ import annotations

import numpy as np

from cache.free_list import FreeList
from cache.hash_index import HashIndex
from cache.lru import LruQueue


def drop_cached(index: HashIndex, lru: LruQueue, free: FreeList, held: np.ndarray) -> int:
    """Forget every cached entry except those `held` this step (busy blocks, pinned
    slots); they become free. Returns how many."""
    ids = np.flatnonzero(lru.present).astype(np.int32)
    ids = ids[~held[ids]]
    lru.remove(ids)
    index.remove(ids)
    free.push(ids)
    return len(ids)


def preload(index: HashIndex, lru: LruQueue, free: FreeList, lo: np.ndarray,
            hi: np.ndarray) -> np.ndarray:
    """Mark free entries as cached under these hashes (absent, distinct): for tools and
    restores, when the KV is known to be there. Returns the ids taken."""
    assert len(lo) <= free.count
    ids = free.pop(len(lo))
    index.insert(ids, lo, hi)
    lru.push(ids)
    return ids
