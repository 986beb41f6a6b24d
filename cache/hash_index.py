"""A hash -> item map for tens of millions of items, with no per-item Python object.

Items are the ids 0..N-1 of one tier (device blocks or host slots); each registered item
has one 128-bit key (lo, hi). A Python dict of int -> int would cost ~100 bytes an entry
(dict slot + two int objects); here an entry costs 47-74 bytes: its key (16), its table
slot (4) and an open-addressing table of uint64 entries at most 30% full (15-30% after
power-of-two rounding). The low load is a measured trade: 2x the table memory bought
~1.5x faster matching (fewer probe rounds, most misses end at the home entry).

A table entry packs a *tag* (the high bits of the key's lo word) with the item id:
``(lo & TAG_MASK) | (item + 1)``; 0 is EMPTY. A probe reads only the table; a tag match
is then confirmed against the item's full key, so a lookup touches about two cache lines
at any scale. Linear probing, power-of-two size, home slot = low bits of lo (a blake2b
output, already uniform). Lookups and inserts take arrays (matching a 28K-block prompt
is a handful of numpy passes, not 28K Python-level probes). Deletes shift the rest of
the probe run back (no tombstones: they would pile up under churn and force a
multi-second rebuild of the 38M-slot host table); that is a short Python loop per key,
a few us, and big batches (reset) re-place the survivors in one vectorised pass instead.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.uint64(0)
# Batches of at most this many keys take the scalar paths (`_find_few`, `_place_few`).
_FEW = 16


def _table_size(num_items: int, max_load: float) -> int:
    size = 8
    while size * max_load < num_items:
        size *= 2
    return size


class HashIndex:
    def __init__(self, num_items: int, max_load: float = 0.3) -> None:
        assert 0 < max_load < 1
        self.num_items = num_items
        size = _table_size(num_items, max_load)
        self._table = np.zeros(size, dtype=np.uint64)  # all EMPTY
        self._mask = np.uint64(size - 1)
        item_bits = num_items.bit_length()  # item + 1 <= num_items
        self._item_mask = np.uint64((1 << item_bits) - 1)
        self._tag_mask = ~self._item_mask
        self._keys = np.zeros((num_items, 2), dtype=np.uint64)  # (lo, hi) per item
        # Same memory viewed as 16-byte scalars: one gather fetches both halves.
        self._keys16 = self._keys.view(np.complex128).reshape(-1)
        self._slot = np.full(num_items, -1, dtype=np.int32)  # table slot, -1 = unregistered
        self.num_keys = 0
        # Scalar views of the same memory, for batches of a few keys (`_find_few`,
        # `_place_few`): a decode step fills a handful of blocks, and numpy's fixed cost
        # per call (~70 us for a find of one key) dwarfs a few Python-level probes.
        self._table_v = memoryview(self._table)
        self._keys_v = memoryview(self._keys.reshape(-1))  # lo of item i at 2i, hi at 2i+1
        self._slot_v = memoryview(self._slot)

    @property
    def table_size(self) -> int:
        return len(self._table)

    def nbytes(self) -> int:
        return self._table.nbytes + self._keys.nbytes + self._slot.nbytes

    def keys_of(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) of registered items (copies)."""
        k = self._keys16[items].view(np.uint64).reshape(-1, 2)
        return k[:, 0].copy(), k[:, 1].copy()

    def is_registered(self, items: np.ndarray) -> np.ndarray:
        return self._slot[items] >= 0

    def registered_mask(self) -> np.ndarray:
        return self._slot >= 0

    def registered_items(self) -> np.ndarray:
        return np.flatnonzero(self._slot >= 0).astype(np.int32)

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Item registered under each key (lo[i], hi[i]), or -1. int32 array."""
        n = len(lo)
        if n <= _FEW and self.num_keys:
            return self._find_few(lo, hi)
        out = np.full(n, -1, dtype=np.int32)
        if n == 0 or self.num_keys == 0:
            return out
        qkeys = np.empty((n, 2), dtype=np.uint64)
        qkeys[:, 0] = lo
        qkeys[:, 1] = hi
        q16 = qkeys.view(np.complex128).reshape(-1)  # 16-byte rows, gathered as one
        qtag = qkeys[:, 0] & self._tag_mask
        active = np.arange(n)
        slots = qkeys[:, 0] & self._mask
        # While many queries are left: one probe distance per round, flat arrays (round 1
        # settles most of them; wider windows measured slower here). Once few are left:
        # a window of entries per query and round, so the long probe runs cost a few
        # rounds instead of one per entry. A key is stored once, between its home and the
        # next EMPTY, so a confirmed match anywhere in a window is the answer and an EMPTY
        # there without one is a miss. Load <= max_load < 1: every run ends at an EMPTY.
        while active.size:
            width = 1 if len(active) > 512 else min(64, 8192 // len(active))
            if width == 1:
                ent = self._table[slots]
                x = ent ^ (qtag if len(active) == n else qtag[active])
            else:
                probe = (slots[:, None] + np.arange(width, dtype=np.uint64)) & self._mask
                ent = self._table[probe].reshape(-1)
                x = ent ^ np.repeat(qtag[active], width)
            # Same tag and an item code >= 1 (x - 1 wraps around for EMPTY).
            c = np.flatnonzero((x - np.uint64(1)) < self._item_mask)
            row = c if width == 1 else c // width
            qa = active[row]
            items = (x[c] - np.uint64(1)).astype(np.intp)
            # Confirm the full 128-bit keys: lo and hi equal <=> both bytes of each pair
            # of bools are 1. A tag match whose key differs (astronomically rare) goes on.
            same = (self._keys16[items].view(np.uint64) == q16[qa].view(np.uint64))
            ok = same.view(np.uint16) == 0x0101
            out[qa[ok]] = items[ok]
            if width == 1:
                cont = ent != EMPTY
                cont[c[ok]] = False
            else:
                done = np.zeros(len(active), dtype=bool)
                done[row[ok]] = True
                done[np.flatnonzero(ent == EMPTY) // width] = True
                cont = ~done
            k = np.flatnonzero(cont)
            active, slots = active[k], (slots[k] + np.uint64(width)) & self._mask
        return out

    def _find_few(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """`find` one key at a time: the same probe sequence, in plain ints."""
        table, keys = self._table_v, self._keys_v
        mask, item_mask, tag_mask = int(self._mask), int(self._item_mask), int(self._tag_mask)
        found = []
        for key_lo, key_hi in zip(np.asarray(lo).tolist(), np.asarray(hi).tolist()):
            slot, tag, item = key_lo & mask, key_lo & tag_mask, -1
            while (e := table[slot]) != 0:
                if e & tag_mask == tag:
                    i = (e & item_mask) - 1
                    if keys[2 * i] == key_lo and keys[2 * i + 1] == key_hi:
                        item = i
                        break
                slot = (slot + 1) & mask
            found.append(item)
        return np.array(found, dtype=np.int32)

    def insert(self, items: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Register each item under its key. Caller guarantees: items unregistered, keys
        absent from the index and distinct within the batch (so no find is needed here)."""
        items = np.asarray(items, dtype=np.int32)
        if items.size == 0:
            return
        assert not self.is_registered(items).any(), "item registered twice"
        assert self.num_keys + len(items) <= self.num_items
        self._keys[items, 0] = lo
        self._keys[items, 1] = hi
        self.num_keys += len(items)
        self._place(items)

    def remove(self, items: np.ndarray) -> None:
        items = np.asarray(items, dtype=np.int32)
        if items.size == 0:
            return
        assert self.is_registered(items).all(), "removing an unregistered item"
        self.num_keys -= len(items)
        if len(items) > max(4096, self.num_keys // 8):
            self._slot[items] = -1  # many: re-place the survivors, vectorised
            self._rebuild()
            return
        table = memoryview(self._table)
        slot_of = memoryview(self._slot)
        keys = memoryview(self._keys.reshape(-1))  # lo of item i at 2 * i
        mask, item_mask = int(self._mask), int(self._item_mask)
        for item in items.tolist():
            i = slot_of[item]
            slot_of[item] = -1
            # Backward shift (Knuth's algorithm R): walk the rest of the probe run and
            # move back every entry whose home is not in (i, j], so no run gets a hole.
            j = i
            while True:
                j = (j + 1) & mask
                e = table[j]
                if e == 0:
                    break
                other = (e & item_mask) - 1
                home = keys[2 * other] & mask
                if (home <= i < j) or (i < j < home) or (j < home <= i):
                    table[i] = e
                    slot_of[other] = i
                    i = j
            table[i] = 0

    def clear(self) -> None:
        self._table.fill(EMPTY)
        self._slot.fill(-1)
        self.num_keys = 0

    def _rebuild(self) -> None:
        """Re-place every registered item into an empty table."""
        live = self.registered_items()
        self._table.fill(EMPTY)
        self._slot.fill(-1)
        self._place(live)

    def _entries(self, items: np.ndarray) -> np.ndarray:
        return (self._keys[items, 0] & self._tag_mask) | (items.astype(np.uint64) + np.uint64(1))

    def _place(self, items: np.ndarray, chunk: int = 1 << 22) -> None:
        """Vectorised linear-probing insert. Every round, each pending item tries its
        current slot; of the items aiming at one empty slot exactly one wins (whichever
        store landed last), the rest move one slot on. Slots only ever fill, so each item
        ends after a run of occupied slots from its home: a valid linear-probing table."""
        if len(items) <= _FEW:
            self._place_few(items)
            return
        table = self._table
        for start in range(0, len(items), chunk):
            pend = items[start:start + chunk]
            ent = self._entries(pend)
            slots = self._keys[pend, 0] & self._mask
            while pend.size:
                free = np.flatnonzero(table[slots] == EMPTY)
                cs, ce = slots[free], ent[free]
                table[cs] = ce
                won = table[cs] == ce
                self._slot[pend[free[won]]] = cs[won].astype(np.int32)
                keep = np.ones(len(pend), dtype=bool)
                keep[free[won]] = False
                pend, ent = pend[keep], ent[keep]
                slots = (slots[keep] + np.uint64(1)) & self._mask

    def _place_few(self, items: np.ndarray) -> None:
        """`_place` one item at a time: its first EMPTY slot from home."""
        table, keys, slot_of = self._table_v, self._keys_v, self._slot_v
        mask, tag_mask = int(self._mask), int(self._tag_mask)
        for item in np.asarray(items).tolist():
            key_lo = keys[2 * item]
            slot = key_lo & mask
            while table[slot] != 0:
                slot = (slot + 1) & mask
            table[slot] = (key_lo & tag_mask) | (item + 1)
            slot_of[item] = slot

    def check(self) -> None:
        """O(N) self-check for tests: every registered item is found at its slot."""
        live = self.registered_items()
        assert len(live) == self.num_keys
        assert (self._table[self._slot[live]] == self._entries(live)).all()
        assert int((self._table != EMPTY).sum()) == self.num_keys
        lo, hi = self.keys_of(live)
        assert (self.find(lo, hi) == live).all()
