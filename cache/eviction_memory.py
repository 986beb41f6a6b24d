"""A bounded memory of the block hashes the cache let go: which tier dropped each one last,
when, and what took its place. cache/miss_reasons.py reads it to tell an evicted prefix
from one never sent.

A tier drops a hash when it reuses the block or slot that held it (an eviction), when a
disk record fails its check, or on a reset; a hash can be dropped by several tiers in
turn (device, then the host copy, then the disk copy), and the last drop is the one
kept. A hash cached again keeps its old record: whoever reads the memory asks the tiers
first.

The records sit in a set-associative table keyed by the hash's low 64-bit word (a blake2b
output: uniform bits): the word picks one set of WAYS entries, holding a 32-bit tag of the
word's high half, and a full set forgets its oldest entry. Sized to the capacity of all
tiers together (at least MIN_ENTRIES), it remembers roughly one whole turnover of the
cache; a hash dropped longer ago, or pushed out of its set early, reads as never cached.
A tag shared by two hashes of one set (about one lookup in 10^9) would name the other
hash's drop: harmless in a diagnostic.

Cost: 9 bytes an entry (tag, float32 time, tier-and-cause code) and a byte per set, i.e.
~9 bytes per block of capacity (the tiers' hash indexes take 47-74, cache/hash_index.py);
a few numpy passes per batch of drops or lookups, with no Python per block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TIERS = ("device", "host", "disk")
# What dropped a hash. device: room for a sequence's first blocks (`admission`), or for
# a running one's next prefill chunk or decode (`growth`); host: room for a device
# block's copy (`write_back`: the device evicted it; `write_through`: it was just
# written) or for a disk read (`disk_read`); disk: room for a write (`disk_write`), or a
# record that failed its check (`bad_read`); any tier: `reset` (reset_prefix_cache).
CAUSES = ("admission", "growth", "write_back", "write_through", "disk_read", "disk_write",
          "bad_read", "reset")
WAYS = 4
MIN_ENTRIES = 4096
# Batches of at most this many drops take the scalar path (`_add_few`): a decode step
# evicts a block or two, and numpy's fixed cost (~20 us an `add`) would be most of it.
_FEW = 8


@dataclass(frozen=True)
class Drop:
    tier: str  # TIERS
    time: float  # the clock's time of the drop
    cause: str  # CAUSES


class EvictionMemory:
    def __init__(self, num_entries: int,
                 clock: Callable[[], float]) -> None:
        self.num_sets = -(-max(num_entries, MIN_ENTRIES) // WAYS)
        shape = (self.num_sets, WAYS)
        # Written whole now (np.full, not np.zeros): the pages of a zeroed table come from
        # the kernel on first write, and a first burst of evictions scattered over a
        # table of hundreds of MB would fault them in inside a step (~1 s measured).
        self._tag = np.full(shape, 0, dtype=np.uint32)  # 0: empty
        self._time = np.full(shape, 0, dtype=np.float32)  # seconds after _t0
        self._code = np.full(shape, 0, dtype=np.uint8)  # tier and cause
        self._next = np.full(self.num_sets, 0, dtype=np.uint8)  # oldest way (mod WAYS)
        # the same memory, flat, for `_add_few`
        self._tag_v = memoryview(self._tag.reshape(-1))
        self._time_v = memoryview(self._time.reshape(-1))
        self._code_v = memoryview(self._code.reshape(-1))
        self._next_v = memoryview(self._next)
        self._clock = clock
        self._t0 = clock()
        self.num_drops = 0

    @property
    def num_entries(self) -> int:
        return self.num_sets * WAYS

    def nbytes(self) -> int:
        return self._tag.nbytes + self._time.nbytes + self._code.nbytes + self._next.nbytes

    def add(self, tier: str, lo: np.ndarray, cause: str) -> None:
        """``tier`` dropped the hashes whose low words are ``lo`` (distinct), now."""
        if len(lo) == 0:
            return
        self.num_drops += len(lo)
        code = TIERS.index(tier) * len(CAUSES) + CAUSES.index(cause)
        if len(lo) <= _FEW:
            self._add_few(np.asarray(lo, dtype=np.uint64).tolist(), code)
            return
        sets, tags = self._locate(lo)
        match = self._tag[sets] == tags[:, None]  # [k, WAYS]
        way = match.argmax(axis=1)
        fresh = np.flatnonzero(~match.any(axis=1))
        if len(fresh):  # each takes its set's oldest entry, several in a set in turn
            s = sets[fresh]
            order = np.argsort(s, kind="stable")
            ranked = s[order]
            starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
            rank = np.empty(len(s), dtype=np.int64)
            rank[order] = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
            way[fresh] = (self._next[s] + rank) % WAYS
            np.add.at(self._next, s, 1)  # wraps at 256, a multiple of WAYS
        self._tag[sets, way] = tags
        self._time[sets, way] = self._clock() - self._t0
        self._code[sets, way] = code

    def _add_few(self, words: list[int], code: int) -> None:
        """`add` for a few hashes, one by one: the same entries the vector path fills."""
        t = self._clock() - self._t0
        tag_v, nxt = self._tag_v, self._next_v
        for lo in words:
            s = lo % self.num_sets
            tag = (lo >> 32) | 1
            base = s * WAYS
            for way in range(WAYS):
                if tag_v[base + way] == tag:
                    break
            else:
                way = nxt[s] % WAYS
                nxt[s] = (nxt[s] + 1) & 0xFF
            i = base + way
            tag_v[i], self._time_v[i], self._code_v[i] = tag, t, code

    def find(self, lo: np.ndarray) -> np.ndarray:
        """The entry of each hash's last drop (int64), or -1 when none is remembered."""
        if len(lo) == 0:
            return np.zeros(0, dtype=np.int64)
        sets, tags = self._locate(lo)
        match = self._tag[sets] == tags[:, None]
        return np.where(match.any(axis=1), sets * WAYS + match.argmax(axis=1), -1)

    def drop(self, entry: int) -> Drop:
        """The drop an entry of `find` records."""
        code = int(self._code.flat[entry])
        return Drop(TIERS[code // len(CAUSES)], self._t0 + float(self._time.flat[entry]),
                    CAUSES[code % len(CAUSES)])

    def _locate(self, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo = np.asarray(lo, dtype=np.uint64)
        sets = (lo % np.uint64(self.num_sets)).astype(np.int64)
        tags = (lo >> np.uint64(32)).astype(np.uint32) | np.uint32(1)  # never 0 (empty)
        return sets, tags
