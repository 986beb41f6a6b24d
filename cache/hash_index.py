"""A hash -> item map for tens of millions of items, with no per-item Python object.

Items are the ids 0..N-1 of one tier (device blocks or host slots); each registered item
has one 128-bit key. A Python dict of int -> int would cost ~100 bytes an entry (dict
slot + two int objects); here an entry costs ~28 bytes: the key halves (16), the item's
table slot (4) and the open-addressing table itself (4 bytes a slot, <= 60% full).

The table holds item ids, not keys: a probe compares the query with the key arrays at
that item. Linear probing, power-of-two size, home slot = low bits of the key's low
word (a blake2b output, so already uniform). Deletes leave tombstones (so a batch of
deletes is one vectorised store); tombstones are reused by inserts and the table is
rebuilt when keys + tombstones pass ``max_fill``. All operations take arrays: the
scheduler matches 28K-block prompts, and a per-item Python loop would cost ~50x more.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
TOMBSTONE = -2


def _table_size(num_items: int, max_load: float) -> int:
    size = 8
    while size * max_load < num_items:
        size *= 2
    return size


class HashIndex:
    def __init__(self, num_items: int, max_load: float = 0.6, max_fill: float = 0.8) -> None:
        assert 0 < max_load < max_fill < 1
        self.num_items = num_items
        size = _table_size(num_items, max_load)
        self._table = np.full(size, EMPTY, dtype=np.int32)  # item id, EMPTY or TOMBSTONE
        self._mask = np.uint64(size - 1)
        self._max_used = int(size * max_fill)
        self.key_lo = np.zeros(num_items, dtype=np.uint64)
        self.key_hi = np.zeros(num_items, dtype=np.uint64)
        self._slot = np.full(num_items, -1, dtype=np.int32)  # table slot, -1 = unregistered
        self.num_keys = 0
        self._num_tombstones = 0

    @property
    def table_size(self) -> int:
        return len(self._table)

    def nbytes(self) -> int:
        return (self._table.nbytes + self.key_lo.nbytes + self.key_hi.nbytes
                + self._slot.nbytes)

    def is_registered(self, items: np.ndarray) -> np.ndarray:
        return self._slot[items] >= 0

    def registered_mask(self) -> np.ndarray:
        return self._slot >= 0

    def registered_items(self) -> np.ndarray:
        return np.flatnonzero(self._slot >= 0).astype(np.int32)

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Item registered under each key (lo[i], hi[i]), or -1. int32 array."""
        n = len(lo)
        out = np.full(n, -1, dtype=np.int32)
        if n == 0 or self.num_keys == 0:
            return out
        active = np.arange(n)
        qlo = np.asarray(lo, dtype=np.uint64)
        qhi = np.asarray(hi, dtype=np.uint64)
        slots = (qlo & self._mask).astype(np.int64)
        table, klo, khi = self._table, self.key_lo, self.key_hi
        # One round per probe distance, over the queries still unresolved. Loads stay
        # <= max_fill, so every probe run ends at an EMPTY slot.
        while active.size:
            v = table[slots]
            occupied = v >= 0
            vv = np.where(occupied, v, 0)
            match = occupied & (klo[vv] == qlo) & (khi[vv] == qhi)
            out[active[match]] = v[match]
            cont = (v != EMPTY) & ~match
            active, qlo, qhi = active[cont], qlo[cont], qhi[cont]
            slots = (slots[cont] + 1) & int(self._mask)
        return out

    def insert(self, items: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Register each item under its key. Caller guarantees: items unregistered, keys
        absent from the index and distinct within the batch (so no find is needed here)."""
        items = np.asarray(items, dtype=np.int32)
        if items.size == 0:
            return
        assert not self.is_registered(items).any(), "item registered twice"
        self.key_lo[items] = lo
        self.key_hi[items] = hi
        if self.num_keys + self._num_tombstones + len(items) > self._max_used:
            self._rebuild()  # drop tombstones before adding, so the table never fills up
        self.num_keys += len(items)
        self._place(items)

    def remove(self, items: np.ndarray) -> None:
        items = np.asarray(items, dtype=np.int32)
        if items.size == 0:
            return
        slots = self._slot[items]
        assert (slots >= 0).all(), "removing an unregistered item"
        self._table[slots] = TOMBSTONE
        self._slot[items] = -1
        self.num_keys -= len(items)
        # A tombstone followed by EMPTY ends every probe run through it anyway: make it
        # EMPTY (decided on the state before this pass, which is conservative).
        nxt = (slots.astype(np.int64) + 1) & int(self._mask)
        clear = self._table[nxt] == EMPTY
        self._table[slots[clear]] = EMPTY
        self._num_tombstones += len(items) - int(clear.sum())

    def clear(self) -> None:
        self._table.fill(EMPTY)
        self._slot.fill(-1)
        self.num_keys = 0
        self._num_tombstones = 0

    def _rebuild(self) -> None:
        """Drop tombstones: re-place every registered item into an empty table."""
        live = self.registered_items()
        self._table.fill(EMPTY)
        self._slot.fill(-1)
        self._num_tombstones = 0
        self._place(live)

    def _place(self, items: np.ndarray, chunk: int = 1 << 22) -> None:
        """Vectorised linear-probing insert. Every round, each pending item tries its
        current slot; of the items aiming at one free slot exactly one wins (whichever
        store landed last), the rest move one slot on. Slots only ever fill, so each item
        ends after a run of occupied slots from its home: a valid linear-probing table."""
        table, mask = self._table, int(self._mask)
        for start in range(0, len(items), chunk):
            pend = items[start:start + chunk]
            slots = (self.key_lo[pend] & self._mask).astype(np.int64)
            while pend.size:
                free = table[slots] < 0
                cand, cs = pend[free], slots[free]
                was_tomb = table[cs] == TOMBSTONE
                table[cs] = cand
                won = table[cs] == cand
                self._slot[cand[won]] = cs[won]
                self._num_tombstones -= int((was_tomb & won).sum())
                placed = np.zeros(len(pend), dtype=bool)
                placed[np.flatnonzero(free)[won]] = True
                pend = pend[~placed]
                slots = (slots[~placed] + 1) & mask

    def check(self) -> None:
        """O(N) self-check for tests: every registered item is found at its slot."""
        live = self.registered_items()
        assert len(live) == self.num_keys
        assert (self._table[self._slot[live]] == live).all()
        assert int((self._table >= 0).sum()) == self.num_keys
        assert int((self._table == TOMBSTONE).sum()) == self._num_tombstones
        assert (self.find(self.key_lo[live], self.key_hi[live]) == live).all()
