"""A rank's side of the disk tier: its DiskStore (worker/disk_store.py) fed from and read
into its host tier, as the plans say.

At start-up the store checks its directory's identity and scans its records; the ranks
then agree, over the process group, on the slots every one of them holds with the same
block hash (a write that landed on some ranks only, a torn record on one, are dropped
everywhere). Those are the blocks found after a restart, reported to the scheduler in
WorkerReady and restored into the rank's digest, as the scheduler restores them into its
index and its digest.
"""

from __future__ import annotations

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


class DiskReadError(RuntimeError):
    """A committed record failed its check when read: the step stops rather than serve it."""


class RankDiskTier:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup, kv: KVCache,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        payload = kv.host_slot_nbytes()
        self.identity = DiskIdentity(
            model_digest=model_files_digest(config.model), dtype=str(dtype).removeprefix("torch."),
            block_size=config.block_size, world_size=tp.world_size, rank=tp.rank,
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            payload_bytes=payload)
        # every rank must have the same slot ids: the minimum over the ranks
        num_slots = tp.all_min(config.disk_cache_size // record_bytes(payload))
        self.kv = kv
        self.store = DiskStore(config.disk_cache_dir, self.identity,
                               num_slots * record_bytes(payload),
                               config.disk_max_queued_writes, config.disk_write_bytes_per_s)
        self.num_slots = self.store.num_slots
        self.found, self.num_torn = self._agree(tp)

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
        its swap_in. A write copies the host slot now (the next plan may reuse it)."""
        if plan.disk_write:
            for write_id, host_slot, disk_slot, lo, hi in plan.disk_write:
                assert 0 <= disk_slot < self.num_slots, f"disk slot {disk_slot} out of range"
                self.store.submit_write(write_id, disk_slot, lo, hi,
                                        self.kv.host_slot_bytes(host_slot))
        for disk_slot, host_slot, lo, hi in plan.disk_read:
            payload = self.store.read(disk_slot, lo, hi)
            if payload is None:
                raise DiskReadError(f"disk slot {disk_slot} failed its check when read")
            self.kv.load_host_slot(host_slot, payload)

    def take_completed(self) -> tuple[list[int], list[int], int]:
        done, dropped = self.store.take_completed()
        return done, dropped, self.store.queue_depth

    def close(self) -> None:
        self.store.flush()
        self.store.close()
