"""A rank's side of the disk tier: its DiskStore (worker/disk_store.py) fed from and read
into its host tier, as the plans say.

At start-up the store checks its directory's identity and scans its records; the ranks
then agree, over the process group, on the slots every one of them holds with the same
block hash (a write that landed on some ranks only, a torn record on one, are dropped
everywhere). Those are the blocks found after a restart, reported to the scheduler in
WorkerReady and restored into the rank's digest, as the scheduler restores them into its
index and its digest.

Reads run on the rank's reader threads, so a step never waits for the disk: a plan's
disk_read ops only start them, into host slots the scheduler reserved, and each rank
reports in its step results the reads it finished (read and checked, or bad). The
scheduler swaps a slot in only by a later plan, once every rank reported it
(cache/disk_flow.py); the rank still joins a read before any copy touches its slot.

A hybrid model's host state snapshots have records of their own, in a second store
(`state_store`, kind "state"): written from and read into host state slots
(worker/linear_state.py) the same way, scanned and agreed at start-up the same way
(cache/state_disk.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
import torch

from wire.config import EngineConfig
from wire.digest import StateDigest
from wire.step import StepPlan
from worker.budget import host_state_slots_for, host_tier_blocks
from worker.disk_store import DiskIdentity, DiskStore, model_files_digest, record_bytes
from worker.distributed import TensorParallelGroup
from worker.kv_cache import KVCache
from worker.linear_state import LinearStateCache

log = structlog.get_logger("disk_tier")

READ_THREADS = 4  # reads in flight per rank: enough to keep an SSD's queue busy
IDLE_WAIT_S = 0.02  # an idle step (no batch) waits this long for a read to finish


@dataclass
class DiskResults:
    """What a rank's disk tier finished since its last step result."""

    write_done: list[int]
    write_dropped: list[int]
    queue_depth: int
    read_done: list[int]
    read_bad: list[int]
    # a hybrid model's state snapshot records (cache/state_disk.py): the same four lists
    state_write_done: list[int] = field(default_factory=list)
    state_write_dropped: list[int] = field(default_factory=list)
    state_read_done: list[int] = field(default_factory=list)
    state_read_bad: list[int] = field(default_factory=list)


@dataclass
class _Reads:
    """One kind of record's reads in flight on this rank: into which host slots, and
    which finished since the last step result."""

    load: Callable[[int, bytes], None]  # (host slot, payload): the record into the slot
    reading: dict[int, Future] = field(default_factory=dict)  # host slot -> its task
    done: list[int] = field(default_factory=list)
    bad: list[int] = field(default_factory=list)


class RankDiskTier:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup, kv: KVCache,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 state: LinearStateCache | None = None, interval: int = 0) -> None:
        """``state``: a hybrid model's state slots, whose host snapshots get records of
        their own (cache/state_disk.py), sized from the same budget as the host tier's:
        one every ``interval`` KV records (the snapshot interval the ranks agreed on,
        worker/budget.py)."""
        assert state is None or interval >= 1, "a disk tier for state needs its interval"
        payload = kv.host_slot_nbytes()
        state_payload = state.host_slot_nbytes if state is not None else 0
        self.identity = DiskIdentity(
            model_digest=model_files_digest(config.model), dtype=str(dtype).removeprefix("torch."),
            block_size=config.block_size, world_size=tp.world_size, rank=tp.rank,
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            payload_bytes=payload, kv_dtype=str(kv.dtype).removeprefix("torch."))
        # every rank must have the same slot ids: the minimum over the ranks
        num_slots = tp.all_min(host_tier_blocks(
            config.disk_cache_size, record_bytes(payload),
            record_bytes(state_payload) if state_payload else 0, interval))
        self.kv = kv
        self.store = DiskStore(config.disk_cache_dir, self.identity,
                               num_slots * record_bytes(payload),
                               config.disk_max_queued_writes, config.disk_write_bytes_per_s)
        self.num_slots = self.store.num_slots
        self.found, self.num_torn = self._agree(tp, self.store)
        # a hybrid model's snapshots: their identity is the KV's with their payload
        self.state = state
        self.state_store: DiskStore | None = None
        self.num_state_slots = 0
        self.state_found: list[tuple[int, int, int]] = []
        if state_payload and host_state_slots_for(self.num_slots, interval):
            self.state_store = DiskStore(
                config.disk_cache_dir, replace(self.identity, payload_bytes=state_payload),
                host_state_slots_for(self.num_slots, interval) * record_bytes(state_payload),
                config.disk_max_queued_writes, config.disk_write_bytes_per_s, kind="state")
            self.num_state_slots = self.state_store.num_slots
            self.state_found, torn = self._agree(tp, self.state_store)
            self.num_torn += torn
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="disk-reader")
        self._lock = threading.Lock()
        self._kv_reads = _Reads(kv.load_host_slot)
        self._state_reads = _Reads(state.load_host_slot if state is not None else _no_state)

    @staticmethod
    def _agree(tp: TensorParallelGroup,
               store: DiskStore) -> tuple[list[tuple[int, int, int]], int]:
        scan = store.scan()
        n = store.num_slots
        lo = np.zeros(n, np.uint64)
        hi = np.zeros(n, np.uint64)
        lo[scan.slots], hi[scan.slots] = scan.lo, scan.hi
        both = torch.from_numpy(np.concatenate([lo, hi]).view(np.int64))
        same = tp.all_agree(both).numpy()
        ok = same[:n] & same[n:] & (lo != 0)
        slots = np.flatnonzero(ok)
        # valid here but not on every rank counts as dropped, like a torn one
        num_torn = scan.num_torn + len(scan.slots) - len(slots)
        log.info("disk_tier_scanned", directory=str(store.directory), kind=store.kind,
                 slots=n, found=len(slots), torn_or_unmatched=num_torn,
                 identity_mismatch=store.stats.identity_mismatch)
        return [(int(s), int(lo[s]), int(hi[s])) for s in slots], num_torn

    def restore_digest(self, digest: StateDigest) -> None:
        digest.restore_disk([s for s, _, _ in self.found], [lo for _, lo, _ in self.found])
        digest.restore_disk_states([s for s, _, _ in self.state_found],
                                   [lo for _, lo, _ in self.state_found])

    def apply(self, plan: StepPlan) -> None:
        """The plan's disk ops, after its swap_out (whose copies must be done) and before
        its swap_in. A write copies the host slot now (the next plan may reuse it); a read
        starts on the reader threads."""
        if plan.disk_write:
            for write_id, host_slot, disk_slot, lo, hi in plan.disk_write:
                assert 0 <= disk_slot < self.num_slots, f"disk slot {disk_slot} out of range"
                assert host_slot not in self._kv_reads.reading, (
                    f"host slot {host_slot} being read")
                self.store.submit_write(write_id, disk_slot, lo, hi,
                                        self.kv.host_slot_bytes(host_slot))
        self._start_reads(plan.disk_read, self.store, self._kv_reads)

    def apply_states(self, plan: StepPlan) -> None:
        """The plan's state disk ops, after its state_swap_out (whose copies must be
        done) and before its state_swap_in, as `apply` for KV."""
        if plan.state_disk_write or plan.state_disk_read:
            assert self.state_store is not None and self.state is not None, (
                "a state disk op without state records")
        for write_id, host_slot, disk_slot, lo, hi in plan.state_disk_write:
            assert host_slot not in self._state_reads.reading, (
                f"host state slot {host_slot} being read")
            self.state_store.submit_write(write_id, disk_slot, lo, hi,
                                          self.state.host_slot_bytes(host_slot))
        if plan.state_disk_read:
            self._start_reads(plan.state_disk_read, self.state_store, self._state_reads)

    def _start_reads(self, ops: list[tuple[int, int, int, int, int]], store: DiskStore,
                     reads: _Reads) -> None:
        for _, disk_slot, host_slot, _, _ in ops:
            assert 0 <= disk_slot < store.num_slots, f"disk slot {disk_slot} out of range"
            assert host_slot not in reads.reading, f"host slot {host_slot} read into twice"
        # one task per reader thread, not per block: a block's read is ~100 us of Python
        per_task = -(-len(ops) // READ_THREADS) if ops else 0
        for i in range(0, len(ops), per_task or 1):
            task = ops[i:i + per_task]
            with self._lock:  # before the task starts: it removes each slot it fills
                f = self._readers.submit(self._read_all, task, store, reads)
                for op in task:
                    reads.reading[op[2]] = f

    def _read_all(self, ops: list[tuple[int, int, int, int, int]], store: DiskStore,
                  reads: _Reads) -> None:
        """On a reader thread: each record into its host slot, if it passes its check;
        each reported as it lands."""
        for read_id, disk_slot, host_slot, lo, hi in ops:
            try:
                payload = store.read(disk_slot, lo, hi)
                if payload is not None:
                    reads.load(host_slot, payload)
            except Exception as exc:  # a failing disk: the block is recomputed, not served
                log.warning("disk_read_failed", slot=disk_slot, kind=store.kind,
                            error=str(exc))
                payload = None
            with self._lock:  # this slot is done, whatever the rest of the task does
                (reads.done if payload is not None else reads.bad).append(read_id)
                del reads.reading[host_slot]

    def join(self, host_slots: list[int], states: bool = False) -> None:
        """Wait for the reads into these host slots (KV, or with ``states`` host state
        slots: a copy is about to touch them). The scheduler plans such a copy only after
        every rank reported the read, so this returns at once unless a plan broke that
        rule."""
        reads = self._state_reads if states else self._kv_reads
        if not reads.reading:
            return
        for slot in host_slots:
            with self._lock:
                f = reads.reading.get(slot)
            if f is not None:
                f.result()

    def take_completed(self, idle: bool = False) -> DiskResults:
        """What finished since the last call. ``idle``: this step ran no batch, so wait a
        little for a read in flight rather than spin through empty steps."""
        both = (self._kv_reads, self._state_reads)
        if idle and any(r.reading for r in both):
            with self._lock:
                nothing = not any(r.done or r.bad for r in both)
                tasks = {f for r in both for f in r.reading.values()}
            if nothing and tasks:
                wait(tasks, IDLE_WAIT_S, FIRST_COMPLETED)
        done, dropped = self.store.take_completed()
        out = DiskResults(done, dropped, self.store.queue_depth, [], [])
        if self.state_store is not None:
            out.state_write_done, out.state_write_dropped = self.state_store.take_completed()
        with self._lock:
            out.read_done, self._kv_reads.done = self._kv_reads.done, []
            out.read_bad, self._kv_reads.bad = self._kv_reads.bad, []
            out.state_read_done, self._state_reads.done = self._state_reads.done, []
            out.state_read_bad, self._state_reads.bad = self._state_reads.bad, []
        return out

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        for store in (self.store, self.state_store):
            if store is not None:
                store.flush()
                store.close()


def _no_state(host_slot: int, payload: bytes) -> None:
    raise AssertionError("a state record read for a model that keeps no state")
