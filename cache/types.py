"""The cache's plain types: its configuration, the ops a step carries to the ranks, a
prefix hit per tier, and what the manager keeps of each sequence (cache/manager.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from cache.hashing import BlockHashChain
from wire.client import UncachedTokens

WRITE_POLICIES = ("write_back", "write_through")


class CacheAccountingError(RuntimeError):
    """Block bookkeeping is inconsistent: serving on would read or free the wrong KV."""


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    num_device_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0  # 0 disables the host tier
    write_policy: str = "write_back"  # host copy on device eviction, or on commit
    enable_prefix_caching: bool = True
    # Of each tier, what blocks marked for retention (`retain`) may hold before the
    # least valuable of them are ordinary LRU blocks (cache/retention.py).
    max_retained_fraction: float = 0.5
    # Record every change of the prefix index as a KV event (cache/events.py), for a
    # cache-aware router; `take_events` drains them. Off: no recorder, no cost.
    record_events: bool = False
    # The disk tier (cache/disk_pool.py): slots below the host tier, written through from
    # it; a write counts once all ``num_ranks`` ranks reported it. 0 disables it.
    num_disk_blocks: int = 0
    num_ranks: int = 1
    # A hybrid model's state slots (cache/state_pool.py): live ones and snapshots; 0: the
    # model has no linear-attention layers.
    num_state_slots: int = 0
    num_host_state_slots: int = 0  # snapshot slots in the host tier (cache/state_host.py)
    num_disk_state_slots: int = 0  # ... and records in the disk tier (cache/state_disk.py)

    def __post_init__(self) -> None:
        assert self.block_size > 0, self.block_size
        assert self.num_device_blocks > 0, self.num_device_blocks
        assert self.num_host_blocks >= 0, self.num_host_blocks
        assert self.write_policy in WRITE_POLICIES, self.write_policy
        assert 0.0 <= self.max_retained_fraction <= 1.0, self.max_retained_fraction
        assert self.num_disk_blocks >= 0 and self.num_ranks >= 1
        assert self.num_state_slots >= 0 and self.num_host_state_slots >= 0

    @property
    def host_enabled(self) -> bool:
        return self.num_host_blocks > 0 and self.enable_prefix_caching

    @property
    def disk_enabled(self) -> bool:
        """The disk tier is fed from the host tier and read back through it."""
        return self.num_disk_blocks > 0 and self.host_enabled

    @property
    def num_device_tokens(self) -> int:
        return self.num_device_blocks * self.block_size

    @property
    def num_host_tokens(self) -> int:
        return self.num_host_blocks * self.block_size


@dataclass
class CacheOps:
    """Block copies for one step, applied by every worker before anything else."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    # (device block, low 64 bits of its hash) registered this step: not a copy, but
    # the ranks mirror it so their state digest covers which hash is where.
    registered: list[tuple[int, int]] = field(default_factory=list)
    # Applied after swap_out and before swap_in, both in the background on each rank
    # (cache/disk_flow.py): (write id, host slot, disk slot, hash lo, hash hi), the host
    # slot's KV (as swap_out left it) written to disk; (read id, disk slot, host slot, lo,
    # hi), a committed record read into a reserved host slot, swapped in by a later plan.
    disk_write: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    disk_read: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # A hybrid model's (cache/state_pool.py): (snapshot slot, live slot) copies restoring
    # prefix hits, and (state slot, hash lo; 0: none) for the digest.
    state_copy: list[tuple[int, int]] = field(default_factory=list)
    state_register: list[tuple[int, int]] = field(default_factory=list)
    # ... and its snapshots between the tiers (cache/state_host.py): (device slot, host
    # slot) demotions, (host slot, live slot) restores
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # ... and between the host and the disk tier (cache/state_disk.py), as disk_write /
    # disk_read: (write id, host state slot, disk state slot, lo, hi), (read id, disk state
    # slot, host state slot, lo, hi)
    state_disk_write: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    state_disk_read: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.disk_write or self.disk_read)


@dataclass(frozen=True)
class PrefixHit:
    num_device_tokens: int  # prompt tokens served by device-resident blocks
    num_host_tokens: int  # prompt tokens served by host slots (swapped in)
    num_disk_tokens: int = 0  # prompt tokens served by disk slots (read, then swapped in)

    @property
    def num_tokens(self) -> int:
        return self.num_device_tokens + self.num_host_tokens + self.num_disk_tokens


@dataclass
class SeqEntry:
    """What the cache knows of a sequence that holds blocks."""
    extra_key: bytes
    chain: BlockHashChain | None  # None when prefix caching is off
    blocks: array  # int32 block table
    hit: PrefixHit
    num_registered: int  # leading blocks already through `commit` (hits included)
    last_commit_step: int = -1
    retain: tuple[tuple[int, float], ...] = ()  # (prompt tokens, TTL s): marked at free
    held: bool = False  # its table is the cached prefix of a waiting sequence (`hold`)
    uncached: UncachedTokens | None = None  # why its first allocate missed the rest
    restore: int = -1  # held: the state snapshot its hit ends at (pinned), a hybrid model's


def as_array(blocks: array) -> np.ndarray:
    # A copy, never a view: a view would pin the array and make a later extend() raise.
    return np.frombuffer(blocks.tobytes(), dtype=np.int32)
