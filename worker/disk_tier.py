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
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from wire.config import EngineConfig
from wire.digest import StateDigest
from wire.step import StepPlan
from worker.disk_store import DiskIdentity, DiskStore, model_files_digest, record_bytes
from worker.distributed import TensorParallelGroup
from worker.kv_cache import KVCache

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


class RankDiskTier:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup, kv: KVCache,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        payload = kv.host_slot_nbytes()
        self.identity = DiskIdentity(
            model_digest=model_files_digest(config.model), dtype=str(dtype).removeprefix("torch."),
            block_size=config.block_size, world_size=tp.world_size, rank=tp.rank,
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            payload_bytes=payload, kv_dtype=str(kv.dtype).removeprefix("torch."))
        # every rank must have the same slot ids: the minimum over the ranks
        num_slots = tp.all_min(config.disk_cache_size // record_bytes(payload))
        self.kv = kv
        self.store = DiskStore(config.disk_cache_dir, self.identity,
                               num_slots * record_bytes(payload),
                               config.disk_max_queued_writes, config.disk_write_bytes_per_s)
        self.num_slots = self.store.num_slots
        self.found, self.num_torn = self._agree(tp)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="disk-reader")
        self._reading: dict[int, Future] = {}  # host slot -> the task reading into it
        self._lock = threading.Lock()
        self._read_done: list[int] = []
        self._read_bad: list[int] = []

    def _agree(self, tp: TensorParallelGroup) -> tuple[list[tuple[int, int, int]], int]:
        scan = self.store.scan()
        lo = np.zeros(self.num_slots, np.uint64)
        hi = np.zeros(self.num_slots, np.uint64)
        lo[scan.slots], hi[scan.slots] = scan.lo, scan.hi
        both = torch.from_numpy(np.concatenate([lo, hi]).view(np.int64))
        same = tp.all_agree(both).numpy()
        ok = same[:self.num_slots] & same[self.num_slots:] & (lo != 0)
        slots = np.flatnonzero(ok)
        # valid here but not on every rank counts as dropped, like a torn one
        num_torn = scan.num_torn + len(scan.slots) - len(slots)
        log.info("disk_tier_scanned", directory=str(self.store.directory), slots=self.num_slots,
                 found=len(slots), torn_or_unmatched=num_torn,
                 identity_mismatch=self.store.stats.identity_mismatch)
        return [(int(s), int(lo[s]), int(hi[s])) for s in slots], num_torn

    def restore_digest(self, digest: StateDigest) -> None:
        digest.restore_disk([s for s, _, _ in self.found], [lo for _, lo, _ in self.found])

    def apply(self, plan: StepPlan) -> None:
        """The plan's disk ops, after its swap_out (whose copies must be done) and before
        its swap_in. A write copies the host slot now (the next plan may reuse it); a read
        starts on the reader threads."""
        if plan.disk_write:
            for write_id, host_slot, disk_slot, lo, hi in plan.disk_write:
                assert 0 <= disk_slot < self.num_slots, f"disk slot {disk_slot} out of range"
                assert host_slot not in self._reading, f"host slot {host_slot} being read"
                self.store.submit_write(write_id, disk_slot, lo, hi,
                                        self.kv.host_slot_bytes(host_slot))
        ops = plan.disk_read
        for _, disk_slot, host_slot, _, _ in ops:
            assert 0 <= disk_slot < self.num_slots, f"disk slot {disk_slot} out of range"
            assert host_slot not in self._reading, f"host slot {host_slot} read into twice"
        # one task per reader thread, not per block: a block's read is ~100 us of Python
        per_task = -(-len(ops) // READ_THREADS) if ops else 0
        for i in range(0, len(ops), per_task or 1):
            task = ops[i:i + per_task]
            with self._lock:  # before the task starts: it removes each slot it fills
                f = self._readers.submit(self._read_all, task)
                for op in task:
                    self._reading[op[2]] = f

    def _read_all(self, ops: list[tuple[int, int, int, int, int]]) -> None:
        """On a reader thread: each record into its host slot, if it passes its check;
        each reported as it lands."""
        for read_id, disk_slot, host_slot, lo, hi in ops:
            try:
                payload = self.store.read(disk_slot, lo, hi)
                if payload is not None:
                    self.kv.load_host_slot(host_slot, payload)
            except Exception as exc:  # a failing disk: the block is recomputed, not served
                log.warning("disk_read_failed", slot=disk_slot, error=str(exc))
                payload = None
            with self._lock:  # this slot is done, whatever the rest of the task does
                (self._read_done if payload is not None else self._read_bad).append(read_id)
                del self._reading[host_slot]

    def join(self, host_slots: list[int]) -> None:
        """Wait for the reads into these host slots (a copy is about to touch them). The
        scheduler plans such a copy only after every rank reported the read, so this
        returns at once unless a plan broke that rule."""
        if not self._reading:
            return
        for slot in host_slots:
            with self._lock:
                f = self._reading.get(slot)
            if f is not None:
                f.result()

    def take_completed(self, idle: bool = False) -> DiskResults:
        """What finished since the last call. ``idle``: this step ran no batch, so wait a
        little for a read in flight rather than spin through empty steps."""
        if idle and self._reading:
            with self._lock:
                nothing = not self._read_done and not self._read_bad
                tasks = set(self._reading.values())
            if nothing and tasks:
                wait(tasks, IDLE_WAIT_S, FIRST_COMPLETED)
        done, dropped = self.store.take_completed()
        with self._lock:
            read_done, self._read_done = self._read_done, []
            read_bad, self._read_bad = self._read_bad, []
        return DiskResults(done, dropped, self.store.queue_depth, read_done, read_bad)

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self.store.flush()
        self.store.close()
