"""An LRU order over item ids 0..N-1 in flat arrays, with batch push / remove / pop.

A doubly linked list costs a few Python-level array touches per item, so taking a
28K-block prefix hit out of the LRU would take ~10 ms. Instead the queue is a log:
``push`` appends ids at the tail and records each id's position; an entry in the log is
live only while its id is present and its recorded position is that entry's own
(re-pushing an id moves it to the tail and leaves a dead entry behind; ``remove`` just
clears ``present``). ``pop`` scans from the head and skips dead entries. When the log
reaches its end it is compacted to the live entries (at most N), so with room for 2N
entries every item costs O(1) amortised and the memory is 9 bytes an item.
"""

from __future__ import annotations

import numpy as np


class LruQueue:
    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        self._log = np.zeros(2 * num_items + 1, dtype=np.int32)
        self._pos = np.full(num_items, -1, dtype=np.int32)  # log position of the live entry
        self.present = np.zeros(num_items, dtype=bool)
        self._head = 0
        self._tail = 0
        self.count = 0

    def nbytes(self) -> int:
        return self._log.nbytes + self._pos.nbytes + self.present.nbytes

    def push(self, ids: np.ndarray) -> None:
        """Make ``ids`` the most recently used, ``ids[0]`` the oldest of them.

        Ids already present move to the tail. ``ids`` must be distinct."""
        ids = np.asarray(ids, dtype=np.int32)
        k = len(ids)
        if k == 0:
            return
        if self._tail + k > len(self._log):
            self._compact()
        assert self._tail + k <= len(self._log)
        self.count += int((~self.present[ids]).sum())
        self._log[self._tail:self._tail + k] = ids
        self._pos[ids] = np.arange(self._tail, self._tail + k, dtype=np.int32)
        self.present[ids] = True
        self._tail += k

    def remove(self, ids: np.ndarray) -> None:
        """Take ``ids`` out of the order (ids not present are ignored)."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        self.count -= int(self.present[ids].sum())
        self.present[ids] = False

    def pop(self, k: int, skip: np.ndarray | None = None) -> np.ndarray:
        """Remove and return up to ``k`` least recently used ids, oldest first.

        Ids with ``skip[id]`` set stay present; the ones passed over move to the tail
        (they are in use this step, so they are the most recently used anyway)."""
        taken: list[np.ndarray] = []
        passed: list[np.ndarray] = []
        need = k
        while need > 0 and self._head < self._tail:
            w = min(self._tail - self._head, max(2 * need, 256))
            lo = self._head
            ent = self._log[lo:lo + w]
            live = self.present[ent] & (self._pos[ent] == np.arange(lo, lo + w))
            if skip is not None:
                skipped = live & skip[ent]
                live &= ~skip[ent]
            idx = np.flatnonzero(live)[:need]
            used = w if len(idx) < need else int(idx[-1]) + 1  # entries consumed
            if skip is not None:
                passed.append(ent[:used][skipped[:used]].copy())
            taken.append(ent[idx].copy())
            need -= len(idx)
            self._head += used
        out = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int32)
        self.present[out] = False
        self._pos[out] = -1
        self.count -= len(out)
        if passed:
            self.push(np.concatenate(passed))
        if self._head == self._tail:
            self._head = self._tail = 0
        return out

    def order(self) -> np.ndarray:
        """Present ids, least recently used first (for tests and inspection)."""
        ent = self._log[self._head:self._tail]
        live = self.present[ent] & (self._pos[ent] == np.arange(self._head, self._tail))
        return ent[live].copy()

    def _compact(self) -> None:
        live = self.order()
        self._log[:len(live)] = live
        self._pos[live] = np.arange(len(live), dtype=np.int32)
        self._head, self._tail = 0, len(live)

    def check(self) -> None:
        live = self.order()
        assert len(live) == self.count == int(self.present.sum())
        assert len(np.unique(live)) == len(live)
