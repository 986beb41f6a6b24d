"""Eviction order with retention: blocks a client asked to keep (Anthropic's
`cache_control`) outlive the others for their TTL.

Agents idle between turns (a user reading, a tool running); their prefixes must still
be cached when they come back, while a burst of one-off long requests passes through.
So each tier orders its cached entries in two ways:

- the plain LRU, evicted first, as before;
- one retained queue per TTL (5 minutes and 1 hour are what clients send), for entries
  marked with that TTL whose last use is less than a TTL ago. They are evicted only once
  the plain LRU is empty, the earliest-expiring first, and each such eviction is counted
  (`early_evictions`: 0 while the retained entries fit the cap).

An entry's retention is refreshed at each use (`touch`: a sequence releasing the block,
a host hit) and ends when its TTL has passed since the last one: `expire` then moves it
to the head of the plain LRU (it is older than anything used within the TTL) and it is
an ordinary entry again. A cap (`max_fraction` of the tier) bounds what may be retained,
so marked prefixes cannot starve new work: a push that would exceed it leaves its least
valuable entries (the first ones, as for the LRU) in the plain order, never an error.

Within one TTL the queue is in order of last use, which is also the order of expiry, so
expiring costs O(expired entries), never a scan. (A host copy keeps its device block's
time of last use; copies arrive in the order the device evicts, earliest expiry first.)
The interface is `LruQueue`'s (push, remove, pop, present, count), so the tiers use it
in its place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cache.lru import LruQueue


@dataclass(frozen=True)
class RetentionPolicy:
    max_fraction: float = 0.5  # of each tier's entries; 0 turns retention off
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        assert 0.0 <= self.max_fraction <= 1.0, self.max_fraction


class RetainingLru:
    def __init__(self, num_items: int, policy: RetentionPolicy | None = None) -> None:
        self.num_items = num_items
        self.policy = policy or RetentionPolicy()
        self.max_retained = int(self.policy.max_fraction * num_items)
        self.plain = LruQueue(num_items)
        self.retained: dict[float, LruQueue] = {}  # one per TTL, in seconds
        self.present = np.zeros(num_items, dtype=bool)  # in any of the queues
        self.ttl_s = np.zeros(num_items, dtype=np.float32)  # 0: not marked
        self.until = np.zeros(num_items, dtype=np.float64)  # retained while now < until
        self.count = 0
        self.num_retained = 0
        self.early_evictions = 0  # retained entries evicted before their TTL

    def nbytes(self) -> int:
        return (self.plain.nbytes() + sum(q.nbytes() for q in self.retained.values())
                + self.present.nbytes + self.ttl_s.nbytes + self.until.nbytes)

    # --- retention state ------------------------------------------------------------------

    def mark(self, ids: np.ndarray, ttl_s: float) -> None:
        """Ask for ``ids``, in use (not in the order), to be retained ``ttl_s`` after each
        use (the longest TTL asked for wins). Takes effect at their next `touch`."""
        ids = np.asarray(ids, dtype=np.int32)
        ids = ids[~self.present[ids]]
        if self.max_retained == 0 or ttl_s <= 0 or len(ids) == 0:
            return
        self.ttl_s[ids] = np.maximum(self.ttl_s[ids], np.float32(ttl_s))

    def touch(self, ids: np.ndarray) -> None:
        """``ids`` were used now: marked ones are retained a TTL from now."""
        ids = np.asarray(ids, dtype=np.int32)
        marked = ids[self.ttl_s[ids] > 0]
        if len(marked):
            self.until[marked] = self.policy.clock() + self.ttl_s[marked]

    def copy_retention(self, dst: np.ndarray, src: RetainingLru, src_ids: np.ndarray) -> None:
        """Entries ``dst`` hold the KV of ``src``'s ``src_ids`` (a swap between tiers):
        they keep its TTL and the time of its last use."""
        if self.max_retained == 0:
            return
        self.ttl_s[dst] = src.ttl_s[src_ids]
        self.until[dst] = src.until[src_ids]

    def release(self, ids: np.ndarray) -> None:
        """``ids`` are retained no more (a session that ended its turn without a tool
        call): cached ones move to the plain LRU as its most recent entries, ``ids[0]``
        the least valuable; ones in use lose their mark before their next release."""
        ids = np.asarray(ids, dtype=np.int32)
        if self.max_retained == 0 or len(ids) == 0:
            return
        queued = ids[self.present[ids] & ~self.plain.present[ids]]  # in a retained queue
        self.remove(queued)
        self.clear(ids)
        self.push(queued)

    def clear(self, ids: np.ndarray) -> None:
        """``ids`` are reused for other KV (evicted, or freed unregistered)."""
        self.ttl_s[ids] = 0
        self.until[ids] = 0

    def is_retained(self, ids: np.ndarray) -> np.ndarray:
        """bool per id: in a retained queue, its TTL not yet passed (`expire` is lazy)."""
        ids = np.asarray(ids, dtype=np.int32)
        if self.num_retained == 0:
            return np.zeros(len(ids), dtype=bool)
        return (self.present[ids] & ~self.plain.present[ids]
                & (self.until[ids] > self.policy.clock()))

    # --- the LruQueue interface -----------------------------------------------------------

    def push(self, ids: np.ndarray) -> None:
        """Make ``ids`` the most recently used, ``ids[0]`` the least valuable of them:
        into their TTL's queue where they are retained and the cap has room, else (and
        the first ones of a push over the cap) into the plain LRU."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        if len(ids) <= 8 and not self._any_retained(ids):  # a decode step's few, plain
            self.remove(ids)
            self.plain.push(ids)
            self.present[ids] = True
            self.count += len(ids)
            return
        self.remove(ids)
        keep = self.until[ids] > self.policy.clock()
        room = self.max_retained - self.num_retained
        if keep.sum() > room:  # over the cap: the least valuable retained ones go plain
            kept = np.flatnonzero(keep)
            keep[kept[: len(kept) - max(room, 0)]] = False
        self.plain.push(ids[~keep])
        for ttl in np.unique(self.ttl_s[ids[keep]]):
            group = ids[keep & (self.ttl_s[ids] == ttl)]
            self._queue(float(ttl)).push(group)
            self.num_retained += len(group)
        self.present[ids] = True
        self.count += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        """Take ``ids`` out of the order (ids not present are ignored)."""
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        ids = ids[self.present[ids]]
        if len(ids) == 0:
            return
        self.plain.remove(ids)
        if self.num_retained:
            for q in self.retained.values():
                before = q.count
                q.remove(ids)
                self.num_retained -= before - q.count
        self.present[ids] = False
        self.count -= len(ids)

    def _any_retained(self, ids: np.ndarray) -> bool:
        """Whether a push of ``ids`` would retain any of them (their TTL runs)."""
        return self.max_retained > 0 and bool((self.until[ids] > self.policy.clock()).any())

    def pop(self, k: int, skip: np.ndarray | None = None,
            retained: bool = True) -> np.ndarray:
        """Remove and return up to ``k`` ids: the plain LRU's oldest first, then (unless
        ``retained`` is False) retained ones, the earliest to expire first (each counted
        in `early_evictions`). Ids with ``skip[id]`` set stay (moved to their queue's
        tail, as `LruQueue.pop` does)."""
        self.expire()
        out = self.plain.pop(k, skip)
        parts = [out]
        taken = len(out)
        while retained and taken < k and self.num_retained:
            q = min((q for q in self.retained.values() if q.count),
                    key=lambda q: self.until[q.head()])
            got = q.pop(1, skip)
            if len(got) == 0:  # everything left in that queue is skipped
                break
            parts.append(got)
            taken += 1
            self.num_retained -= 1
            self.early_evictions += 1
        out = np.concatenate(parts).astype(np.int32) if len(parts) > 1 else out
        self.present[out] = False
        self.count -= len(out)
        return out  # their retention stays until `clear`: a write-back copies it first

    def expire(self) -> int:
        """Retained entries whose TTL has passed since their last use become ordinary:
        to the head of the plain LRU, earliest first. Returns how many."""
        now = self.policy.clock()
        done: list[np.ndarray] = []
        for q in self.retained.values():
            expired: list[int] = []
            while q.count and self.until[q.head()] <= now:
                x = q.head()
                q.remove(np.array([x], dtype=np.int32))
                expired.append(x)
            if expired:
                done.append(np.array(expired, dtype=np.int32))
        if not done:
            return 0
        ids = np.concatenate(done)
        ids = ids[np.argsort(self.until[ids], kind="stable")]
        self.num_retained -= len(ids)
        self.ttl_s[ids] = 0
        self.plain.push_front(ids)
        return len(ids)

    def check(self) -> None:
        self.plain.check()
        members = self.plain.present.copy()
        retained = 0
        for ttl, q in self.retained.items():
            q.check()
            assert not (members & q.present).any(), "an id in two queues"
            members |= q.present
            assert (self.ttl_s[q.present] == np.float32(ttl)).all()
            retained += q.count
        assert (members == self.present).all()
        assert self.count == int(self.present.sum())
        assert self.num_retained == retained <= max(self.max_retained, 0)

    def _queue(self, ttl: float) -> LruQueue:
        q = self.retained.get(ttl)
        if q is None:
            q = self.retained[ttl] = LruQueue(self.num_items)
        return q
