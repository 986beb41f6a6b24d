"""A stack of free item ids in one int32 array (4 bytes an item, batch push and pop)."""

from __future__ import annotations

import numpy as np


class FreeList:
    def __init__(self, num_items: int) -> None:
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (readable logs and tests).
        self._stack = np.arange(num_items - 1, -1, -1, dtype=np.int32)
        self.count = num_items
        self.is_free = np.ones(num_items, dtype=bool)

    def nbytes(self) -> int:
        return self._stack.nbytes + self.is_free.nbytes

    def pop(self, k: int) -> np.ndarray:
        k = min(k, self.count)
        out = self._stack[self.count - k:self.count][::-1].copy()
        self.count -= k
        self.is_free[out] = False
        return out

    def push(self, ids: np.ndarray) -> None:
        """Return ids to the pool; they are handed out again in the order given."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        assert not self.is_free[ids].any(), "item freed twice"
        self.is_free[ids] = True
        self._stack[self.count:self.count + len(ids)] = ids[::-1]
        self.count += len(ids)

    def take(self, ids: np.ndarray) -> None:
        """Take these particular free ids out of the pool (a restore at start-up)."""
        ids = np.asarray(ids, dtype=np.int32)
        assert self.is_free[ids].all(), "taking an id that is not free"
        self.is_free[ids] = False
        stack = self._stack[:self.count]
        rest = stack[self.is_free[stack]]
        self._stack[:len(rest)] = rest
        self.count = len(rest)
