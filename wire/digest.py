"""The state digest every rank returns each step, and the scheduler predicts.

The scheduler keeps one for what it told the ranks, each rank one for what it
applied; equal values mean equal state, so a rank that missed or misapplied an op
is caught at the step it happened. It covers

- every live sequence's block table: (sequence, index in table) -> block;
- which block hash lives in which device block and which host slot (hashes enter
  through `StepPlan.register` and move with swap_out / swap_in);
- which block hash each disk slot was told to hold (moved by disk_write / disk_read;
  whether a rank's background write landed is reported apart, StepResult.disk_done);
- a hybrid model's state snapshots: which block hash each state slot holds the state at
  (`StepPlan.state_register`; hash 0 removes the entry, when the slot is reused or
  dropped), and which hash each host state slot holds (`StepPlan.state_swap_out` gives it
  the device slot's, as a KV swap_out does).

It is a sum of per-entry hashes mod 2^64, so a step costs O(delta), not O(state):
a 450K-token block table is never rehashed. Tier contents are numpy arrays, 8 bytes
per block or slot, so a full-scale host tier costs a few hundred MB, not GBs of dicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from wire.step import StepPlan

_MASK64 = (1 << 64) - 1
# Up to this many entries, an update is cheaper in plain ints than in numpy (whose fixed
# cost per call, ~1 us, is then most of the work).
FEW = 8
_U = np.uint64


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a fixed, seedless integer hash (same in every process)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """The same function over a 1-D uint64 array. Its arithmetic wraps silently (numpy
    scalars and 0-d arrays warn on overflow, and no caller passes one), so no errstate:
    entering one costs a microsecond, more than the arithmetic on a step's few entries."""
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def _entry(kind: int, a: int, b: int) -> int:
    return _mix64(_mix64(kind ^ (a << 8)) ^ b)


def _entries(kind: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """_entry(kind, a[i], b[i]) for every i (uint64 arrays)."""
    return _mix64_np(_mix64_np(_U(kind) ^ (a << _U(8))) ^ b)


def _entries_sum(kind: int, ids: np.ndarray, hashes: np.ndarray) -> int:
    """Sum of _entry(kind, id, hash) over pairs whose hash is set (non-zero)."""
    keep = hashes != 0
    if not keep.any():
        return 0
    e = _entries(kind, ids[keep].astype(np.uint64), hashes[keep])
    return int(e.sum(dtype=np.uint64))


def samples_digest(sampled: list[tuple[int, int]]) -> int:
    """A rank's sampled (seq id, token) pairs as one number (StepResult.sampled_digest);
    never 0, so 0 can mean "did not sample". Python's own tuple hash: for ints it is the
    same in every process (PYTHONHASHSEED salts only str and bytes), and it runs in C --
    this sits between a rank's forward and its next, where mixing each pair in Python
    cost ~0.3 ms at batch 256."""
    return hash(tuple(sampled)) or 1


def table_digest(seq_id: int, block_ids: list[int] | np.ndarray, start: int = 0) -> int:
    """What `StateDigest.add_blocks` adds for these table entries (positions start,
    start+1, ...), vectorised: new 28K-block tables cost microseconds, not a Python loop.
    The inspect CLI also uses it to compare a rank's real tables with the mirror."""
    if len(block_ids) == 0:
        return 0
    entries, _ = _table_entries([seq_id], [start], [block_ids])
    return int(entries.sum(dtype=np.uint64))


def _table_entries(seq_ids: list[int], starts: list[int],
                   block_lists: list[list[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each table entry's term, flat over the lists (list i: sequence seq_ids[i], table
    positions starts[i], starts[i] + 1, ...), and where each list starts in it. The key
    of an entry is the sequence in the high 32 bits and the position in the low ones."""
    counts = np.array([len(ids) for ids in block_lists], dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    seq_bits = np.array([(seq_id << 32) & _MASK64 for seq_id in seq_ids], dtype=np.uint64)
    positions = np.arange(counts.sum()) + np.repeat(np.asarray(starts) - offsets, counts)
    keys = np.repeat(seq_bits, counts) | positions.astype(np.uint64)
    blocks = block_lists[0] if len(block_lists) == 1 else [b for ids in block_lists for b in ids]
    values = np.asarray(blocks, dtype=np.int64).astype(np.uint64)
    return _entries(StateDigest.SEQ_BLOCK, keys, values), offsets


def _few_table_sum(seq_id: int, start: int, block_ids: list[int]) -> int:
    """`table_digest` in plain ints: a decode step appends one block, and numpy's fixed
    cost per call is then most of the work."""
    s = 0
    for i, b in enumerate(block_ids, start=start):
        s = (s + _entry(StateDigest.SEQ_BLOCK, (seq_id << 32) | i, b)) & _MASK64
    return s


# A hybrid model's state tables (`tier_digests`' names), by the tier their slots are in
STATE_TIERS = {"state": "device", "host_state": "host", "disk_state": "disk"}
MAX_TIER_SLICE = 1 << 20  # hashes per TierRequest answer (wire/control.py)


class StateDigest:
    SEQ_BLOCK = 1
    DEVICE_HASH = 2
    HOST_HASH = 3
    DISK_HASH = 4
    STATE_HASH = 5
    HOST_STATE_HASH = 6
    DISK_STATE_HASH = 7

    def __init__(self, num_device_blocks: int = 0, num_host_blocks: int = 0,
                 num_disk_blocks: int = 0) -> None:
        self.value = 0
        self._seq_sums: dict[int, int] = {}
        self._seq_lens: dict[int, int] = {}
        self._block_hash = np.zeros(num_device_blocks, dtype=np.uint64)  # 0: none
        self._slot_hash = np.zeros(num_host_blocks, dtype=np.uint64)
        self._disk_hash = np.zeros(num_disk_blocks, dtype=np.uint64)
        # plain-int views of the same memory: a decode step registers a few blocks, and
        # numpy's fixed cost per call is then most of the digest's (`_set`)
        self._block_view = memoryview(self._block_hash)
        self._slot_view = memoryview(self._slot_hash)
        self._disk_view = memoryview(self._disk_hash)
        # state slot -> hash: a few snapshots change per step, and no size is needed up
        # front (a model without linear-attention layers has none)
        self._state_hash: dict[int, int] = {}
        self._host_state_hash: dict[int, int] = {}  # host state slot -> hash
        self._disk_state_hash: dict[int, int] = {}  # disk state slot -> hash

    def add_blocks(self, seq_id: int, block_ids: list[int]) -> None:
        n = self._seq_lens.get(seq_id, 0)
        if len(block_ids) > FEW:
            s = table_digest(seq_id, block_ids, start=n)
        else:
            s = _few_table_sum(seq_id, n, block_ids)
        self._seq_lens[seq_id] = n + len(block_ids)
        self._seq_sums[seq_id] = (self._seq_sums.get(seq_id, 0) + s) & _MASK64
        self.value = (self.value + s) & _MASK64

    def _add_tables(self, tables: list[tuple[int, list[int]]]) -> None:
        """`add_blocks` of each (seq_id, block_ids), in order, in one numpy pass: a step
        that opens several sequences adds dozens of entries, ~1.5 us each in Python."""
        lens, sums = self._seq_lens, self._seq_sums
        first, filled = [], []  # the lists with blocks, and each one's first table position
        for seq_id, ids in tables:
            n = lens.get(seq_id, 0)
            lens[seq_id] = n + len(ids)
            sums.setdefault(seq_id, 0)  # a table opened empty is live all the same
            if ids:
                first.append(n)
                filled.append((seq_id, ids))
        tables = filled
        e, offsets = _table_entries([seq_id for seq_id, _ in tables], first,
                                    [ids for _, ids in tables])
        per_list = np.add.reduceat(e, offsets, dtype=np.uint64).tolist()
        for (seq_id, _), s in zip(tables, per_list):
            sums[seq_id] = (sums[seq_id] + s) & _MASK64
        self.value = (self.value + sum(per_list)) & _MASK64

    def trim_blocks(self, seq_id: int, num_blocks: int, block_ids: list[int]) -> None:
        """Drop table entries [num_blocks, num_blocks + len(block_ids)), which must be
        the table's last ones and hold `block_ids`."""
        assert self._seq_lens[seq_id] == num_blocks + len(block_ids), (
            f"seq {seq_id}: trim to {num_blocks} of {self._seq_lens[seq_id]} blocks "
            f"names {len(block_ids)}")
        s = _few_table_sum(seq_id, num_blocks, block_ids)
        self._seq_lens[seq_id] = num_blocks
        self._seq_sums[seq_id] = (self._seq_sums[seq_id] - s) & _MASK64
        self.value = (self.value - s) & _MASK64

    def close(self, seq_id: int) -> None:
        s = self._seq_sums.pop(seq_id)
        del self._seq_lens[seq_id]
        self.value = (self.value - s) & _MASK64

    def _set(self, kind: int, table: np.ndarray, view: memoryview, ids: list[int],
             hashes: np.ndarray | list[int]) -> None:
        if len(ids) <= FEW:
            self._set_few(kind, view, ids, hashes)
            return
        assert len(set(ids)) == len(ids), "an op list names a block or slot twice"
        idx = np.asarray(ids, dtype=np.int64)
        old, new = table[idx], np.asarray(hashes, dtype=np.uint64)
        table[idx] = new
        # the old entries and the new in one pass; an unset hash (0) is no entry
        both = np.concatenate((old, new))
        e = _entries(kind, np.concatenate((idx, idx)).astype(np.uint64), both)
        e[both == 0] = 0
        n = len(idx)
        delta = int(e[n:].sum(dtype=np.uint64)) - int(e[:n].sum(dtype=np.uint64))
        self.value = (self.value + delta) & _MASK64

    def _set_few(self, kind: int, table: memoryview, ids: list[int],
                 hashes: np.ndarray | list[int]) -> None:
        """`_set` in plain ints: the same sum, entry by entry."""
        assert len(set(ids)) == len(ids), "an op list names a block or slot twice"
        delta = 0
        for i, h in zip(ids, hashes.tolist() if isinstance(hashes, np.ndarray) else hashes):
            old = table[i]
            if old:
                delta -= _entry(kind, i, old)
            if h:
                delta += _entry(kind, i, h)
            table[i] = h
        self.value = (self.value + delta) & _MASK64

    def apply(self, plan: StepPlan) -> None:
        """Advance the digest by a plan, in the order ranks apply it."""
        if plan.swap_out:
            blocks, slots = zip(*plan.swap_out)
            self._set(self.HOST_HASH, self._slot_hash, self._slot_view, list(slots),
                      self._block_hash[np.asarray(blocks, dtype=np.int64)])
        if plan.disk_write:
            slots = [op[1] for op in plan.disk_write]
            self._set(self.DISK_HASH, self._disk_hash, self._disk_view,
                      [op[2] for op in plan.disk_write],
                      self._slot_hash[np.asarray(slots, dtype=np.int64)])
        if plan.disk_read:  # the slot is told to hold it now; swapped in by a later plan
            disk = [op[1] for op in plan.disk_read]
            self._set(self.HOST_HASH, self._slot_hash, self._slot_view,
                      [op[2] for op in plan.disk_read],
                      self._disk_hash[np.asarray(disk, dtype=np.int64)])
        if plan.swap_in:
            slots, blocks = zip(*plan.swap_in)
            self._set(self.DEVICE_HASH, self._block_hash, self._block_view, list(blocks),
                      self._slot_hash[np.asarray(slots, dtype=np.int64)])
        for seq_id in plan.close:
            self.close(seq_id)
        for t in plan.trim:
            self.trim_blocks(t.seq_id, t.num_blocks, t.block_ids)
        tables = [(seq.seq_id, seq.block_ids) for seq in plan.new_seqs]
        tables += [(app.seq_id, app.block_ids) for app in plan.append]
        if sum(len(ids) for _, ids in tables) > FEW:
            self._add_tables(tables)
        else:
            for seq_id, block_ids in tables:
                self.add_blocks(seq_id, block_ids)
        if plan.register:
            blocks, hashes = zip(*plan.register)
            self._set(self.DEVICE_HASH, self._block_hash, self._block_view, list(blocks),
                      list(hashes))
        if plan.state_swap_out:  # the device slots' hashes as the plan found them
            self._set_states([(host, self._state_hash.get(slot, 0))
                              for slot, host in plan.state_swap_out],
                             self._host_state_hash, self.HOST_STATE_HASH)
        if plan.state_disk_write:  # the host slots' hashes, as for KV's disk_write
            self._set_states([(disk, self._host_state_hash.get(host, 0))
                              for _, host, disk, _, _ in plan.state_disk_write],
                             self._disk_state_hash, self.DISK_STATE_HASH)
        if plan.state_disk_read:  # the host slot is told to hold it now
            self._set_states([(host, self._disk_state_hash.get(disk, 0))
                              for _, disk, host, _, _ in plan.state_disk_read],
                             self._host_state_hash, self.HOST_STATE_HASH)
        if plan.state_register:
            self._set_states(plan.state_register)

    def _set_states(self, pairs: list[tuple[int, int]], table: dict[int, int] | None = None,
                    kind: int = STATE_HASH) -> None:
        """(state slot, hash lo) pairs, in order; hash 0: the slot holds no snapshot."""
        table, delta = self._state_hash if table is None else table, 0
        for slot, h in pairs:
            old = table.pop(slot, 0)
            if old:
                delta -= _entry(kind, slot, old)
            if h:
                delta += _entry(kind, slot, h)
                table[slot] = h
        self.value = (self.value + delta) & _MASK64

    def state_hashes(self) -> dict[int, int]:
        """State slot -> the hash (lo) of the block its snapshot ends at (a copy)."""
        return dict(self._state_hash)

    def host_state_hashes(self) -> dict[int, int]:
        """Host state slot -> the hash (lo) its snapshot was last told to hold (a copy)."""
        return dict(self._host_state_hash)

    def disk_state_hashes(self) -> dict[int, int]:
        """Disk state slot -> the hash (lo) its record was last told to hold (a copy)."""
        return dict(self._disk_state_hash)

    def state_entries(self) -> dict[str, int]:
        """Per state table (STATE_TIERS), the slots told to hold a snapshot."""
        return {"state": len(self._state_hash), "host_state": len(self._host_state_hash),
                "disk_state": len(self._disk_state_hash)}

    def state_slice(self, tier: str, start: int, stop: int) -> list[int]:
        """The hash (lo) each slot of a state table (STATE_TIERS) in [start, stop) was told
        to hold, 0 for none: the state tables' `tier_hashes` (they are kept sparse)."""
        table = {"state": self._state_hash, "host_state": self._host_state_hash,
                 "disk_state": self._disk_state_hash}[tier].copy()
        return [table.get(slot, 0) for slot in range(start, stop)]

    def restore_disk_states(self, slots: list[int] | np.ndarray,
                            hashes: list[int] | np.ndarray) -> None:
        """Warm restart: disk state slots found holding these hashes (low 64 bits), on
        every rank."""
        self._set_states([(int(s), int(h)) for s, h in zip(slots, hashes)],
                         self._disk_state_hash, self.DISK_STATE_HASH)

    def restore_disk(self, slots: list[int] | np.ndarray, hashes: list[int] | np.ndarray) -> None:
        """Warm restart: disk slots found holding these hashes (low 64 bits), on every
        rank and in the scheduler alike."""
        if len(slots):
            self._set(self.DISK_HASH, self._disk_hash, self._disk_view,
                      [int(s) for s in slots], np.asarray(hashes, dtype=np.uint64))

    @property
    def live_seqs(self) -> list[int]:
        return sorted(self._seq_lens)

    # --- views for inspection (read from another thread: copies, never iterators) ---

    def tables(self) -> dict[int, tuple[int, int]]:
        """seq id -> (number of blocks, table digest) of every live table."""
        lens, sums = dict(self._seq_lens), dict(self._seq_sums)
        return {sid: (n, sums.get(sid, 0)) for sid, n in lens.items()}

    def table_slice(self, table: str, start: int, stop: int, num_state_slots: int = 0,
                    ) -> list[int]:
        """A TierRequest's answer: the hash of each slot of a KV tier or a state table
        (``num_state_slots`` of them) in [start, stop), at most MAX_TIER_SLICE."""
        if table in STATE_TIERS:
            return self.state_slice(table, start,
                                    min(stop, num_state_slots, start + MAX_TIER_SLICE))
        hashes = self.tier_hashes(table)
        return hashes[start:min(stop, len(hashes), start + MAX_TIER_SLICE)].tolist()

    def tier_hashes(self, tier: str) -> np.ndarray:
        """The hash held by each device block or host slot (0: none); do not modify."""
        return {"device": self._block_hash, "host": self._slot_hash,
                "disk": self._disk_hash}[tier]

    def tier_digests(self, chunk: int = 1 << 20) -> dict[str, int]:
        """Per tier, the digest's part for which hash lives in which block or slot
        (in chunks: a full-scale host tier has tens of millions of slots)."""
        out = {}
        for tier, kind in (("device", self.DEVICE_HASH), ("host", self.HOST_HASH),
                           ("disk", self.DISK_HASH)):
            table, total = self.tier_hashes(tier), 0
            for start in range(0, len(table), chunk):
                part = table[start:start + chunk].copy()
                ids = np.arange(start, start + len(part))
                total = (total + _entries_sum(kind, ids, part)) & _MASK64
            out[tier] = total
        state = 0
        for slot, h in list(self._state_hash.items()):
            state = (state + _entry(self.STATE_HASH, slot, h)) & _MASK64
        out["state"] = state
        host_state = 0
        for slot, h in list(self._host_state_hash.items()):
            host_state = (host_state + _entry(self.HOST_STATE_HASH, slot, h)) & _MASK64
        out["host_state"] = host_state
        disk_state = 0
        for slot, h in list(self._disk_state_hash.items()):
            disk_state = (disk_state + _entry(self.DISK_STATE_HASH, slot, h)) & _MASK64
        out["disk_state"] = disk_state
        return out
