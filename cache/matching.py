"""Which tier holds each block of a prompt's prefix (cache/admission.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cache.block_pool import DevicePool
from cache.disk_pool import DiskPool
from cache.hashing import BlockHashChain
from cache.host_pool import HostPool


@dataclass
class Match:
    num_blocks: int
    device: np.ndarray  # int32 [num_blocks]: device block, or -1 where the host serves it
    host: np.ndarray  # int32 [num_blocks]: host slot where device is -1
    disk: np.ndarray  # int32 [num_blocks]: disk slot where device and host are -1


def match_prefix(device: DevicePool, host: HostPool, disk: DiskPool,
                 token_ids: Sequence[int], chain: BlockHashChain) -> Match:
    """Longest prefix of full blocks found in any tier (device, then host, then disk,
    per block).

    Hashes lazily in growing chunks and stops at the first miss, so a miss costs
    little hashing while a long hit pays for every block once."""
    cap = max(len(token_ids) - 1, 0) // chain.block_size
    dev_parts: list[np.ndarray] = []
    host_parts: list[np.ndarray] = []
    disk_parts: list[np.ndarray] = []
    # A disk hit needs a host slot to land in: at most the host slots `host.take`
    # could give now (free, or plain LRU and not pinned; this prompt's own host
    # hits are pinned by its allocate). Past that the prefix is recomputed.
    disk_room = _disk_room(host, disk)
    # Chunks growing 8x (256, 2K, 16K, ...; hashes already known: 256 then the
    # rest), so a miss early in a long prompt costs little hashing and few lookups,
    # and a long hit a few passes.
    n, chunk = 0, 256
    while n < cap:
        upto = cap if n and chain.num_blocks >= cap else min(cap, n + chunk)
        num_hashed = chain.extend(token_ids, upto)
        assert num_hashed >= upto
        lo, hi = chain.keys(n, upto)
        dev = device.index.find(lo, hi)
        at_host = np.full(len(dev), -1, dtype=np.int32)
        miss = np.flatnonzero(dev < 0)
        if host.num_slots and len(miss):
            at_host[miss] = host.find(lo[miss], hi[miss])
        at_disk = np.full(len(dev), -1, dtype=np.int32)
        miss = np.flatnonzero((dev < 0) & (at_host < 0))
        if disk.num_slots and len(miss):
            at_disk[miss] = disk.find(lo[miss], hi[miss])
            over = np.flatnonzero(at_disk >= 0)[disk_room:]
            at_disk[over] = -1
            disk_room -= int((at_disk >= 0).sum())
        ok = (dev >= 0) | (at_host >= 0) | (at_disk >= 0)
        k = len(ok) if ok.all() else int(np.argmin(ok))
        dev_parts.append(dev[:k])
        host_parts.append(at_host[:k])
        disk_parts.append(at_disk[:k])
        n += k
        if k < len(ok):
            break
        chunk *= 8
    empty = np.zeros(0, dtype=np.int32)
    return Match(n, np.concatenate(dev_parts) if dev_parts else empty,
                  np.concatenate(host_parts) if host_parts else empty,
                  np.concatenate(disk_parts) if disk_parts else empty)


def truncated(m: Match, num_blocks: int) -> Match:
    """The first ``num_blocks`` blocks of a match (a hybrid model's hit ends at its last
    state snapshot, cache/state_pool.py)."""
    if num_blocks >= m.num_blocks:
        return m
    return Match(num_blocks, m.device[:num_blocks], m.host[:num_blocks], m.disk[:num_blocks])


def _disk_room(host: HostPool, disk: DiskPool) -> int:
    """Host slots a disk hit could land in now: free, or plain LRU and not pinned."""
    if not disk.num_slots:
        return 0
    return max(0, host.free.count + host.lru.plain.count - host.num_pinned)
