"""What moves between the host tier and the disk tier, planned by the scheduler: host
copies written through to disk, and disk hits read back into host slots, for
cache/manager.py.

A read takes as long as the disk does, so it never sits inside a step: the plan that
admits a sequence whose prefix continues on disk only *starts* the reads (StepPlan.
disk_read, every rank the same ops, each on its own reader threads, worker/disk_tier.py)
into host slots reserved for them, and the sequence waits while the others step. Each
rank reports the reads it finished (StepResult.disk_read_done / disk_read_bad); once every
rank has reported all of a sequence's reads, its next admission `settle`s them: a block
every rank read and checked becomes an ordinary host hit (swapped in by that later plan,
then its prefill); a block whose record failed its check on *any* rank is dropped from
the disk index and its host slot freed, so every rank recomputes those tokens and none
serves them -- the ranks agree because the scheduler decides from all their reports,
the same way a write is committed only once every rank wrote it.

A sequence aborted with reads in flight is `cancel`led: its host slots and disk slots
stay held until every rank has reported the reads (a reader thread may still be filling
the slot), then go back free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache.disk_pool import DiskPool
from cache.events import KVEventRecorder
from cache.eviction_memory import EvictionMemory
from cache.host_pool import HostPool
from cache.stats import CacheStats


@dataclass
class _Staged:
    host: np.ndarray  # int32: the reserved host slots the reads fill
    disk: np.ndarray  # int32: the disk slots read
    lo: np.ndarray  # uint64: their block hashes
    hi: np.ndarray
    cancelled: bool = False


class DiskFlow:
    def __init__(self, host: HostPool, disk: DiskPool, num_ranks: int, stats: CacheStats,
                 events: KVEventRecorder | None, drops: EvictionMemory | None = None) -> None:
        self.host, self.disk, self.stats, self.events = host, disk, stats, events
        self.drops = drops  # told of the host slots a read evicts (cache/miss_reasons.py)
        n = host.num_slots
        self._all_ranks = np.uint64((1 << num_ranks) - 1)
        # per host slot, the read filling it: its id (generation * n + slot), the ranks
        # that reported it, and whether any found the record bad
        self._read_id = np.full(n, -1, dtype=np.int64)
        self._generation = np.zeros(n, dtype=np.int64)
        self._reported = np.zeros(n, dtype=np.uint64)
        self._bad = np.zeros(n, dtype=bool)
        self._staged: dict[int, _Staged] = {}
        self._cancelled: list[_Staged] = []
        # per sequence, host slots its settled reads filled (counted as disk hits)
        self._read_back: dict[int, np.ndarray] = {}

    @property
    def num_in_flight(self) -> int:
        return sum(len(s.host) for s in self._staged.values()) + sum(
            len(s.host) for s in self._cancelled)

    # --- writes ---------------------------------------------------------------------

    def write_through(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                      ops: list) -> None:
        """Host slots just given a swap_out (hashes lo/hi): write them to disk in the
        background, where the disk has no copy yet (cache/disk_pool.py)."""
        w = self.disk.plan_writes(lo, hi)
        if len(w):
            i = w.index
            ops.extend(zip(w.write_id.tolist(), slots[i].tolist(), w.slot.tolist(),
                           lo[i].tolist(), hi[i].tolist()))
        self.stats.num_disk_write_blocks = self.disk.num_planned_writes

    # --- reads ----------------------------------------------------------------------

    def stage(self, seq_id: int, disk_slots: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              ops: list) -> None:
        """Start reading these committed disk slots (a sequence's disk hits, hashes
        lo/hi) into host slots reserved for them. `_match` counted the room."""
        assert seq_id not in self._staged, f"seq {seq_id} already has reads in flight"
        slots, evicted, evicted_lo = self.host.take(len(disk_slots))
        assert len(slots) == len(disk_slots), "no host slot for a disk hit"
        if self.drops is not None:
            self.drops.add("host", evicted_lo, "disk_read")
        if self.events is not None:
            self.events.host_removed(evicted_lo)
        self.stats.num_host_evictions += len(evicted)
        self.host.reserve(slots)
        self.disk.begin_read(disk_slots)
        n = max(self.host.num_slots, 1)
        ids = self._generation[slots] * n + slots
        self._generation[slots] += 1
        self._read_id[slots] = ids
        self._reported[slots] = 0
        self._bad[slots] = False
        self._staged[seq_id] = _Staged(slots, np.asarray(disk_slots, np.int32), lo, hi)
        ops.extend(zip(ids.tolist(), disk_slots.tolist(), slots.tolist(), lo.tolist(),
                       hi.tolist()))
        self.stats.num_disk_read_blocks += len(slots)

    def report(self, rank: int, done: list[int], bad: list[int]) -> None:
        """A rank's finished reads (StepResult.disk_read_done / disk_read_bad)."""
        if not done and not bad:
            return
        ids = np.asarray(list(done) + list(bad), dtype=np.int64)
        slots = (ids % max(self.host.num_slots, 1)).astype(np.int32)
        assert (self._read_id[slots] == ids).all(), f"rank {rank} reported a read never started"
        bit = np.uint64(1 << rank)
        assert not (self._reported[slots] & bit).any(), f"rank {rank} reported a read twice"
        self._reported[slots] |= bit
        self._bad[slots[len(done):]] = True
        if self._cancelled:
            still = []
            for st in self._cancelled:
                if self._all_read(st):
                    self._end(st)
                    self.host.release(st.host)
                else:
                    still.append(st)
            self._cancelled = still

    def is_staged(self, seq_id: int) -> bool:
        return seq_id in self._staged

    def settle(self, seq_id: int) -> bool:
        """False while ``seq_id``'s reads are in flight on some rank. Once all are in:
        the blocks read and checked everywhere become host hits (registered, pinned for
        this step's swap_in); the others are dropped, their tokens to be recomputed."""
        st = self._staged.get(seq_id)
        if st is None:
            return True
        if not self._all_read(st):
            return False
        del self._staged[seq_id]
        bad = self._end(st)
        self.host.release(st.host[bad])
        ok = ~bad
        host, lo, hi = st.host[ok], st.lo[ok], st.hi[ok]
        self.host.unreserve(host)
        # the same block may have reached the host meanwhile (another sequence's copy, or
        # its own second read): keep that one
        dup = self.host.find(lo, hi) >= 0
        if dup.any():
            self.host.free.push(host[dup])
            host, lo, hi = host[~dup], lo[~dup], hi[~dup]
        self.host.register(host, lo, hi)
        before = self._read_back.get(seq_id)
        self._read_back[seq_id] = host if before is None else np.concatenate([before, host])
        return True

    def take_read_back(self, seq_id: int) -> np.ndarray:
        """The host slots ``seq_id``'s reads filled (its admission counts their hits as
        disk hits); forgotten once taken."""
        return self._read_back.pop(seq_id, np.zeros(0, np.int32))

    def cancel(self, seq_id: int) -> None:
        """``seq_id`` leaves before its reads are used (an abort): its slots are freed once
        every rank has reported the reads."""
        self._read_back.pop(seq_id, None)
        st = self._staged.pop(seq_id, None)
        if st is None:
            return
        if self._all_read(st):
            self._end(st)
            self.host.release(st.host)
        else:
            st.cancelled = True
            self._cancelled.append(st)

    def _all_read(self, st: _Staged) -> bool:
        return bool((self._reported[st.host] == self._all_ranks).all())

    def _end(self, st: _Staged) -> np.ndarray:
        """The reads of ``st`` are over on every rank; returns which failed on some rank."""
        bad = self._bad[st.host].copy()
        self._read_id[st.host] = -1
        self.disk.end_read(st.disk, bad)
        return bad

    def check(self) -> None:
        held = [s.host for s in self._staged.values()] + [s.host for s in self._cancelled]
        slots = np.concatenate(held) if held else np.zeros(0, np.int32)
        assert len(np.unique(slots)) == len(slots), "a host slot read into twice"
        assert int(self.host.reserved.sum()) == len(slots) and self.host.reserved[slots].all()
        assert ((self._read_id >= 0) == self.host.reserved).all()
        disk = [s.disk for s in self._staged.values()] + [s.disk for s in self._cancelled]
        counts = np.bincount(np.concatenate(disk) if disk else np.zeros(0, np.int64),
                             minlength=self.disk.num_slots)
        assert (counts[:self.disk.num_slots] == self.disk.reading).all()
