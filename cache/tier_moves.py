"""What a step writes and moves between the tiers, as the ops of its plan, for
cache/manager.py: the blocks its sequences filled, registered in the prefix index
(`commit`; copied to the host a step later under write_through), fresh device blocks
(evicting cached ones, written back to the host under write_back), and every host copy
written through to disk (cache/disk_flow.py). The order in which ranks apply the ops,
which all of this relies on: cache/manager.py."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from cache.block_pool import DevicePool
from cache.disk_flow import DiskFlow
from cache.disk_pool import DiskPool
from cache.events import KVEventRecorder
from cache.host_pool import HostPool
from cache.miss_reasons import MissAttribution
from cache.state_pool import StatePool
from cache.stats import CacheStats
from cache.types import CacheConfig, CacheOps, SeqEntry, as_array


class TierMoves:
    """The ops queued for this step, and the registrations, evictions and copies behind
    them, over the manager's sequences (``seqs``, shared with it)."""

    def __init__(self, config: CacheConfig, device: DevicePool, host: HostPool,
                 disk: DiskPool, disk_flow: DiskFlow, misses: MissAttribution,
                 stats: CacheStats, events: KVEventRecorder | None, state: StatePool | None,
                 seqs: dict[int, SeqEntry]) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = device
        self.host = host
        self.disk = disk
        self.disk_flow = disk_flow
        self.misses = misses
        self.stats = stats
        self.events = events
        self.state = state
        self.seqs = seqs
        self.ops = CacheOps()
        # Blocks committed this step under write_through: their KV is written by this
        # step's forward pass, so their copy to the host goes into the *next* step's ops.
        self._write_through_next: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def num_allocatable(self) -> int:
        """Blocks `take_fresh` could hand out now (free + evictable)."""
        return self.device.num_free + self.device.num_evictable()

    def take_ops(self) -> CacheOps:
        """Drain this step's ops (call exactly once per step, even when empty)."""
        ops, self.ops = self.ops, CacheOps()
        if self.state is not None:
            ops.state_copy, ops.state_register = self.state.take_ops()
            ops.state_swap_out, ops.state_swap_in = self.state.take_swaps()
            if self.state.disk is not None:
                ops.state_disk_write, ops.state_disk_read = self.state.disk.take_ops()
        self.device.clear_busy()
        self.host.unpin_all()
        self.disk.unpin_all()
        pending, self._write_through_next = self._write_through_next, []
        for blocks, lo, hi in pending:
            # Still indexed, and referenced unless their sequence was closed as they were
            # registered (`commit(closing=True)`: busy, so not evicted in that step).
            assert (self.device.index.keys_of(blocks)[0] == lo).all()
            self.copy_to_host(blocks[::-1], lo[::-1], hi[::-1])  # tail first
        return ops

    def peek_ops(self) -> CacheOps:
        """The ops queued so far for this step (a copy; nothing is drained)."""
        ops = CacheOps(list(self.ops.swap_out), list(self.ops.swap_in),
                       list(self.ops.registered), list(self.ops.disk_write),
                       list(self.ops.disk_read))
        if self.state is not None:
            ops.state_copy, ops.state_register = self.state.peek_ops()
            ops.state_swap_out, ops.state_swap_in = self.state.peek_swaps()
            if self.state.disk is not None:
                ops.state_disk_write = list(self.state.disk.write_ops)
                ops.state_disk_read = list(self.state.disk.read_ops)
        return ops

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
               step: int, *, closing: bool = False) -> None:
        """`KVCacheManager.commit`."""
        seq = self.seqs[seq_id]
        seq.last_commit_step = step
        if seq.chain is None:
            return
        n_full = num_computed_tokens // self.block_size
        assert num_computed_tokens <= len(token_ids), "committing tokens that are not known"
        assert n_full <= len(seq.blocks), "committing tokens beyond the allocated blocks"
        start = seq.num_registered
        if n_full <= start:
            if self.state is not None:  # snapshots taken at blocks registered already
                self.state.commit(seq_id, seq.chain, start)
            return
        num_hashed = seq.chain.extend(token_ids, n_full)
        assert num_hashed >= n_full
        lo, hi = seq.chain.keys(start, n_full)
        blocks = as_array(seq.blocks[start:n_full])
        new = self.device.index.find(lo, hi) < 0
        if self.events is not None and new.any():
            parent_lo = seq.chain.keys(start - 1, start)[0] if start else lo[:0]
            self.events.device_stored(blocks[new], start + np.flatnonzero(new),
                                      np.concatenate([parent_lo, lo]), start - len(parent_lo),
                                      token_ids)
        seq.num_registered = n_full
        self.register(blocks[new], lo[new], hi[new], closing)
        if self.state is not None:
            self.state.commit(seq_id, seq.chain, n_full)

    def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]], step: int) -> None:
        """`KVCacheManager.commit_many`."""
        if self.events is not None:  # events name each sequence's parent hashes
            for seq_id, token_ids, num_computed in commits:
                self.commit(seq_id, token_ids, num_computed, step)
            return
        bs = self.block_size
        keys: list[tuple[np.ndarray, np.ndarray]] = []
        tables: list[array] = []
        for seq_id, token_ids, num_computed in commits:
            seq = self.seqs[seq_id]
            seq.last_commit_step = step
            n_full = num_computed // bs
            start = seq.num_registered
            if seq.chain is None or n_full <= start:
                if seq.chain is not None and self.state is not None:
                    self.state.commit(seq_id, seq.chain, start)
                continue
            assert num_computed <= len(token_ids), "committing tokens that are not known"
            assert n_full <= len(seq.blocks), "committing tokens beyond the allocated blocks"
            num_hashed = seq.chain.extend(token_ids, n_full)
            assert num_hashed >= n_full
            keys.append(seq.chain.keys(start, n_full))
            tables.append(seq.blocks[start:n_full])
            seq.num_registered = n_full
            if self.state is not None:
                self.state.commit(seq_id, seq.chain, n_full)
        if not keys:
            return
        lo = np.concatenate([k[0] for k in keys])
        hi = np.concatenate([k[1] for k in keys])
        blocks = np.frombuffer(b"".join(t.tobytes() for t in tables), dtype=np.int32)
        new = self.device.index.find(lo, hi) < 0
        # Two sequences may fill blocks of the same hash in one step (the same prompt
        # and tokens): as one after the other, the first registers it, the second keeps
        # its copy unindexed.
        pairs = list(zip(lo.tolist(), hi.tolist()))
        if len(set(pairs)) < len(pairs):
            seen: set[tuple[int, int]] = set()
            for i, key in enumerate(pairs):
                if new[i]:
                    new[i] = key not in seen
                    seen.add(key)
        self.register(blocks[new], lo[new], hi[new], closing=False)

    def take_fresh(self, k: int, cause: str = "growth") -> np.ndarray:
        """``k`` blocks with refcount 1, evicting (and writing back) cached ones if needed.
        ``cause``: what they are for, `admission` or `growth` (cache/eviction_memory.py)."""
        # An evicted block may become, this very step, a swap_in target or get new KV:
        # safe only because workers apply its swap_out (queued below) before both.
        blocks, evicted, lo, hi = self.device.take(k)
        self.misses.dropped("device", lo, cause)
        if self.events is not None:
            self.events.device_removed(lo)
        self.stats.num_device_evictions += len(evicted)
        self.stats.num_device_retained_evictions = self.device.lru.early_evictions
        if (len(evicted) and self.config.write_policy == "write_back"
                and self.config.host_enabled):
            self.copy_to_host(evicted, lo, hi)  # with their retention, if any
        self.device.lru.clear(evicted)
        return blocks

    def register(self, blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 closing: bool) -> None:
        """Index referenced blocks newly filled (`commit`), and queue them for the ranks."""
        self.device.register(blocks, lo, hi)
        if closing:  # hittable at once, but not evictable before this step's ops drain
            self.device.mark_busy(blocks)
        self.ops.registered.extend(zip(blocks.tolist(), lo.tolist()))
        if self.config.write_policy == "write_through" and self.config.host_enabled:
            self._write_through_next.append((blocks, lo, hi))

    def copy_to_host(self, blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Queue swap_out of device blocks whose hashes the host does not hold yet.

        ``blocks`` come least valuable first (LRU order: a freed chain's tail before its
        head). Best effort: when every other host slot is pinned this step, the least
        valuable ones are dropped -- a chain without its head would be useless."""
        assert not self.device.busy[blocks].any(), "copying a block whose KV is not loaded"
        miss = self.host.find(lo, hi) < 0
        blocks, lo, hi = blocks[miss], lo[miss], hi[miss]
        slots, evicted, evicted_lo = self.host.take(len(blocks))
        self.misses.dropped("host", evicted_lo, self.config.write_policy)
        if self.events is not None:
            self.events.host_removed(evicted_lo)
        self.stats.num_host_evictions += len(evicted)
        self.stats.num_host_retained_evictions = self.host.lru.early_evictions
        n = len(slots)
        blocks, lo, hi = blocks[len(blocks) - n:], lo[len(lo) - n:], hi[len(hi) - n:]
        self.host.lru.copy_retention(slots, self.device.lru, blocks)
        self.host.register(slots, lo, hi)
        if self.events is not None:
            self.events.host_stored(blocks, lo)
        self.ops.swap_out.extend(zip(blocks.tolist(), slots.tolist()))
        self.stats.num_swap_out_blocks += n
        if self.disk.num_slots and n:  # write-through to disk, in the background
            self.disk_flow.write_through(slots, lo, hi, self.ops.disk_write)
