"""Hellos, readiness and goodbyes: how a rank and the shim join the scheduler, and leave.

    rank -> scheduler    WorkerConnect; then WorkerReady, or StartFailed
    scheduler -> rank    EngineConfig (wire/config.py), then step plans, then Shutdown
    shim -> scheduler    ClientHello
    scheduler -> shim    EngineInfo; Shutdown when the engine goes away
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WorkerConnect:
    """A rank's first message; the scheduler answers with the EngineConfig. `pid` and
    `host_id` (host_identity below) let the scheduler tell a dead rank
    (on its own host) from a slow one."""

    rank: int
    world_size: int
    pid: int
    host_id: str


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can hold and serve. Each rank reports its own (WorkerReady), the
    scheduler agrees one across the ranks (the KV block counts are agreed already, as
    the minimum over the ranks) and hands it to the shim (EngineInfo)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_device_blocks: int
    num_host_blocks: int
    kv_bytes_per_block: int = 0
    num_disk_blocks: int = 0  # disk slots per rank (0: no disk tier)
    # A hybrid model (linear-attention layers beside attention, worker/linear_state.py):
    # the state slots of each rank, the running sequences' live ones and the snapshots
    # together (cache/state_pool.py), and the bytes of one on a rank. 0: no such layers.
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
    # ... and the host tier's snapshot slots (cache/state_host.py), from the host budget
    # as the device's from its own: one every --state-snapshot-interval host blocks
    num_host_state_slots: int = 0
    # ... and the disk tier's snapshot records (cache/state_disk.py), one every
    # --state-snapshot-interval disk blocks
    num_disk_state_slots: int = 0
    # ... and the interval the ranks snapshot at, in blocks (--state-snapshot-interval, or
    # under `auto` what the ranks chose from the byte sizes, worker/budget.py): the
    # scheduler plans snapshots at this one, never at the config's. 0: no such layers.
    state_snapshot_interval: int = 0

    @property
    def is_hybrid(self) -> bool:
        return self.num_state_slots > 0


@dataclass
class WorkerReady:
    """A rank has loaded its shard and allocated its KV tiers."""

    rank: int
    device: str
    limits: EngineLimits
    # Warm restart (worker/disk_store.py): the disk slots every rank holds valid, with the
    # same block hash, as (slot, hash lo, hash hi); the ranks agreed on them at start-up.
    disk_found: list[tuple[int, int, int]] = field(default_factory=list)
    # ... and the state snapshot records found so (a hybrid model's)
    state_disk_found: list[tuple[int, int, int]] = field(default_factory=list)
    disk_torn: int = 0  # records this rank found damaged, or not valid on every rank
    disk_identity_mismatch: bool = False  # the directory held another engine's: ignored


@dataclass
class StartFailed:
    """A rank could not start (load its shard, allocate its KV, join the process group)."""

    rank: int
    error: str


@dataclass
class ClientHello:
    """The shim's first message; the scheduler answers with EngineInfo."""

    pid: int


@dataclass
class EngineInfo:
    """The scheduler's answer to a ClientHello: what the shim serves."""

    model: str
    block_size: int
    world_size: int
    limits: EngineLimits


@dataclass
class Shutdown:
    reason: str = ""


def host_identity() -> str:
    """This machine and PID namespace. Two processes with the same identity see the same
    pids; a hostname alone is not enough (containers on host networking share it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, pid_ns = "", 0
    return f"{socket.gethostname()}/{boot}/{pid_ns}"
