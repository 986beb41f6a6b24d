"""A hybrid model's state snapshots in the disk tier, planned by the scheduler: a host
snapshot written through to a disk record of its own, under the hash of the block it ends
at, and a disk snapshot read back into a host slot at admission (no tensors here).

It is the KV disk flow (cache/disk_flow.py) for the other kind of record: the same
`DiskPool` index (a slot committed once every rank wrote it, found again by the restart
scan and agreed across ranks, worker/disk_tier.py), and the same reads -- the plan that
admits a sequence whose last snapshot is on disk only *starts* the read
(StepPlan.state_disk_read) into a host state slot held for it, the sequence waits, and
once every rank reported the read its next admission `settle`s it: read and checked
everywhere, the host slot holds the snapshot (a host hit, restored by StepPlan.
state_swap_in); bad on any rank, the record leaves the index and the tokens past the
previous snapshot are recomputed.

A snapshot is written when the device demotes it to the host (cache/state_pool.py), as a
KV block is written when it is swapped out to the host under the write-through policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache.disk_pool import DiskPool
from cache.state_host import HostStates, Key


@dataclass
class _Read:
    read_id: int
    host: int  # the host state slot it fills
    disk: int
    key: Key
    reported: int = 0  # ranks that reported it, a bit each
    bad: bool = False
    cancelled: bool = False


class StateDisk:
    def __init__(self, num_slots: int, host: HostStates, num_ranks: int) -> None:
        self.pool = DiskPool(num_slots, num_ranks)
        self.host = host
        self._all_ranks = (1 << num_ranks) - 1
        self._next_id = 0
        self._reads: dict[int, _Read] = {}  # read id -> the read
        self._staged: dict[int, _Read] = {}  # seq id -> its read in flight
        self.write_ops: list[tuple[int, int, int, int, int]] = []  # this plan's
        self.read_ops: list[tuple[int, int, int, int, int]] = []

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The committed disk state slot of each key, or -1."""
        return self.pool.find(lo, hi)

    def write_through(self, host_slot: int, key: Key) -> None:
        """``host_slot`` just took the snapshot of ``key`` (a swap_out): write it to disk,
        unless the disk has it (committed or pending)."""
        w = self.pool.plan_writes(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64))
        for _, write_id, disk_slot in w:
            self.write_ops.append((write_id, host_slot, disk_slot, key[0], key[1]))

    def stage(self, seq_id: int, disk_slot: int, key: Key) -> bool:
        """Start reading the committed record ``disk_slot`` (the snapshot of ``key``) into
        a host state slot; False when the host has no slot to give."""
        assert seq_id not in self._staged, f"seq {seq_id} already reads a snapshot"
        host = self.host.take_for_read()
        if host < 0:
            return False
        self.pool.begin_read(np.array([disk_slot], np.int32))
        read = _Read(self._next_id, host, disk_slot, key)
        self._next_id += 1
        self._reads[read.read_id] = self._staged[seq_id] = read
        self.read_ops.append((read.read_id, disk_slot, host, key[0], key[1]))
        return True

    def report(self, rank: int, write_done: list[int], write_dropped: list[int],
               read_done: list[int], read_bad: list[int]) -> None:
        """A rank's finished state writes and reads (StepResult.state_disk_*)."""
        self.pool.report(rank, write_done, write_dropped)
        bit = 1 << rank
        for read_id, bad in [(i, False) for i in read_done] + [(i, True) for i in read_bad]:
            read = self._reads.get(read_id)
            assert read is not None and not read.reported & bit, (
                f"rank {rank} reported state read {read_id} never started, or twice")
            read.reported |= bit
            read.bad |= bad
            if read.cancelled and read.reported == self._all_ranks:
                self._end(read)
                self.host.release(read.host)

    def is_staged(self, seq_id: int) -> bool:
        return seq_id in self._staged

    def settle(self, seq_id: int) -> bool:
        """False while ``seq_id``'s read is in flight on some rank; once it is in on every
        rank, its snapshot is a host one (or, bad somewhere, dropped)."""
        read = self._staged.get(seq_id)
        if read is None:
            return True
        if read.reported != self._all_ranks:
            return False
        del self._staged[seq_id]
        self._end(read)
        if read.bad:
            self.host.release(read.host)
        else:
            self.host.fill(read.host, read.key)
        return True

    def cancel(self, seq_id: int) -> None:
        """``seq_id`` leaves with its read unused: its host slot is freed once every rank
        has reported the read (a reader thread may still be filling it)."""
        read = self._staged.pop(seq_id, None)
        if read is None:
            return
        if read.reported == self._all_ranks:
            self._end(read)
            self.host.release(read.host)
        else:
            read.cancelled = True

    def take_ops(self) -> tuple[list, list]:
        """This plan's (state_disk_write, state_disk_read)."""
        ops = self.write_ops, self.read_ops
        self.write_ops, self.read_ops = [], []
        return ops

    def restore(self, found: list[tuple[int, int, int]]) -> None:
        """Warm restart: the records every rank found valid, (slot, hash lo, hash hi)."""
        if found:
            slots, lo, hi = (np.array(col, dtype=dt) for col, dt in
                             zip(zip(*found), (np.int32, np.uint64, np.uint64)))
            self.pool.restore(slots, lo, hi)

    def _end(self, read: _Read) -> None:
        del self._reads[read.read_id]
        self.pool.end_read(np.array([read.disk], np.int32), np.array([read.bad]))

    def check(self) -> None:
        self.pool.check()
        reading = np.bincount([r.disk for r in self._reads.values()],
                              minlength=self.pool.num_slots)
        assert (reading[:self.pool.num_slots] == self.pool.reading).all()
