"""An exact LRU order over item ids 0..N-1: a doubly linked list in flat arrays.

Batch operations are vectorised, because a prefix hit takes ~28K blocks out of the LRU
at once and closing a sequence puts them back:
  push    links the ids into a chain and splices it in at the tail: O(k);
  remove  unlinks any set of ids, however they are spread over the list. Removed ids
          form runs of list neighbours; each run is spliced out by linking the survivor
          before its first id to the survivor after its last. Runs are paired up by a
          push stamp per id (the list is in stamp order): O(k + r log r) for r runs;
  pop     walks k steps from the head (a walk cannot be vectorised): ~0.1 us a step.
No operation touches more than the ids it is given (no compaction pauses, as a lazy log
would need). Memory: 17 bytes an item. Node N is a sentinel: head = next[N],
tail = prev[N].

A decode step moves a few ids at a time (a block filled, one evicted), where numpy's
fixed cost per call is most of the work: batches of up to `_FEW` ids take a plain-int
path over memoryviews of the same arrays, the same links and stamps.
"""

from __future__ import annotations

import numpy as np

_FEW = 8


class LruQueue:
    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        s = num_items  # the sentinel
        self._prev = np.full(num_items + 1, s, dtype=np.int32)
        self._next = np.full(num_items + 1, s, dtype=np.int32)
        self._present = np.zeros(num_items + 1, dtype=bool)
        self._present[s] = True  # never removed: every run of removed ids has survivors
        self.present = self._present[:num_items]  # view: is each item in the order?
        self._stamp = np.zeros(num_items + 1, dtype=np.int64)  # push order
        self._clock = 0
        self._front_clock = 0  # push_front's stamps count down from here: list order holds
        self.count = 0
        self._prev_v, self._next_v = memoryview(self._prev), memoryview(self._next)
        self._present_v, self._stamp_v = memoryview(self._present), memoryview(self._stamp)

    def nbytes(self) -> int:
        return (self._prev.nbytes + self._next.nbytes + self._present.nbytes
                + self._stamp.nbytes)

    def push(self, ids: np.ndarray) -> None:
        """Make ``ids`` the most recently used, ``ids[0]`` the oldest of them.

        Ids already present move to the tail. ``ids`` must be distinct."""
        if len(ids) <= _FEW:
            self._push_few(ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
            return
        ids = np.asarray(ids, dtype=np.int32)
        self.remove(ids)
        s = self.num_items
        tail = self._prev[s]
        self._next[ids[:-1]] = ids[1:]
        self._prev[ids[1:]] = ids[:-1]
        self._next[tail] = ids[0]
        self._prev[ids[0]] = tail
        self._next[ids[-1]] = s
        self._prev[s] = ids[-1]
        self._present[ids] = True
        self._stamp[ids] = np.arange(self._clock, self._clock + len(ids))
        self._clock += len(ids)
        self.count += len(ids)

    def push_front(self, ids: np.ndarray) -> None:
        """Make ``ids`` the least recently used, ``ids[0]`` the oldest of all. ``ids`` must
        be distinct."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        self.remove(ids)
        s = self.num_items
        head = self._next[s]
        self._next[ids[:-1]] = ids[1:]
        self._prev[ids[1:]] = ids[:-1]
        self._prev[head] = ids[-1]
        self._next[ids[-1]] = head
        self._next[s] = ids[0]
        self._prev[ids[0]] = s
        self._present[ids] = True
        self._stamp[ids] = np.arange(self._front_clock - len(ids), self._front_clock)
        self._front_clock -= len(ids)
        self.count += len(ids)

    def head(self) -> int:
        """The least recently used id, or -1 when empty."""
        x = int(self._next[self.num_items])
        return -1 if x == self.num_items else x

    def remove(self, ids: np.ndarray) -> None:
        """Take ``ids`` out of the order (ids not present are ignored)."""
        if len(ids) <= _FEW:
            self._remove_few(ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
            return
        ids = np.asarray(ids, dtype=np.int32)
        ids = ids[self._present[ids]]
        if len(ids) == 0:
            return
        self._present[ids] = False
        self.count -= len(ids)
        p, n = self._prev[ids], self._next[ids]
        # A run of removed list neighbours starts at an id whose predecessor survives
        # and ends at one whose successor survives (the sentinel always does); sorted by
        # stamp, the i-th start and the i-th end belong to the same run.
        first = np.flatnonzero(self._present[p])
        last = np.flatnonzero(self._present[n])
        first = first[np.argsort(self._stamp[ids[first]], kind="stable")]
        last = last[np.argsort(self._stamp[ids[last]], kind="stable")]
        before, after = p[first], n[last]
        self._next[before] = after
        self._prev[after] = before

    def _push_few(self, ids: list[int]) -> None:
        self._remove_few(ids)
        s, prev, nxt, stamp = self.num_items, self._prev_v, self._next_v, self._stamp_v
        for x in ids:
            tail = prev[s]
            nxt[tail], prev[x] = x, tail
            nxt[x], prev[s] = s, x
            self._present_v[x] = True
            stamp[x] = self._clock
            self._clock += 1
        self.count += len(ids)

    def _remove_few(self, ids: list[int]) -> None:
        prev, nxt, present = self._prev_v, self._next_v, self._present_v
        for x in ids:
            if present[x]:
                present[x] = False
                p, n = prev[x], nxt[x]
                nxt[p], prev[n] = n, p
                self.count -= 1

    def pop(self, k: int, skip: np.ndarray | None = None) -> np.ndarray:
        """Remove and return up to ``k`` least recently used ids, oldest first.

        Ids with ``skip[id]`` set stay present; the ones passed over move to the tail
        (they are in use this step, so they are the most recently used anyway)."""
        s = self.num_items
        nxt = memoryview(self._next)
        sk = memoryview(skip) if skip is not None else None
        taken: list[int] = []
        passed: list[int] = []
        x = nxt[s]
        while len(taken) < k and x != s:
            if sk is not None and sk[x]:
                passed.append(x)
            else:
                taken.append(x)
            x = nxt[x]
        out = np.array(taken, dtype=np.int32)
        self.remove(out)
        if passed:
            self.push(np.array(passed, dtype=np.int32))
        return out

    def order(self) -> np.ndarray:
        """Present ids, least recently used first (a walk: for tests and inspection)."""
        nxt = memoryview(self._next)
        s = self.num_items
        out: list[int] = []
        x = nxt[s]
        while x != s:
            out.append(x)
            x = nxt[x]
        return np.array(out, dtype=np.int32)

    def check(self) -> None:
        live = self.order()
        assert len(live) == self.count == int(self.present.sum())
        assert self.present[live].all()
        s = self.num_items
        assert (self._prev[np.append(live[1:], s)] == live).all()
        if len(live):
            assert self._prev[live[0]] == s
