"""The disk tier and the host tier that feeds it, sized at launch when `--disk-cache-dir`
comes without their sizes: a share of what this node has free, split among its ranks,
bounded; and a refusal of what cannot work, before any process starts.

    room = measure_room(prepare_disk_dir(directory), num_local_ranks)
    sizes = size_disk_tiers(disk_cache_size, host_cache_memory, room)   # None: size it

Both sizes are bytes per rank, as the flags take them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog

from wire.config import ConfigError, is_disk_records_file

log = structlog.get_logger()

# The disk tier takes half of the free space at its directory: the rest stays for
# whatever else lives on that filesystem (logs, checkpoints, other tenants).
DISK_SHARE = 0.5
# The host tier takes a fifth of the free RAM: the rest stays for the weights a CPU rank
# holds, the CPU device tier (worker/budget.py), the page cache the disk tier reads
# through, and the processes beside the engine.
HOST_SHARE = 0.2
DISK_MAX_PER_RANK = 1 << 40  # 1 TiB: past it a rank's start-up scan of its records drags
HOST_MAX_PER_RANK = 32 << 30  # pinned on CUDA: pinning takes seconds per tens of GiB
# Below this a share is too small to be worth a tier: the user is asked for a size.
MIN_PER_RANK = 64 << 20
# Sizes are rounded down to this, so the free space moving a little between two launches
# does not change the disk tier's size (a smaller budget cuts its file: records lost).
GRANULE = 64 << 20


@dataclass(frozen=True)
class NodeRoom:
    """What this node has free for the tiers, measured once at launch."""

    directory: Path  # the disk tier's
    free_disk_bytes: int  # there, counting the tier's own record files (reused)
    free_memory_bytes: int  # the RAM available (MemAvailable)
    num_local_ranks: int  # the ranks on this node share both


@dataclass(frozen=True)
class TierSizes:
    disk_cache_size: int  # bytes per rank
    host_cache_memory: int  # bytes per rank


def prepare_disk_dir(directory: str | Path) -> Path:
    """The disk tier's directory, created (0700, as the ranks do) so that its free space
    can be measured and a directory that cannot be made is refused now, not by a rank."""
    path = Path(directory).resolve()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--disk-cache-dir {directory}: cannot create it ({exc.strerror})"
                         ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--disk-cache-dir {directory}: not writable by this user")
    return path


def available_memory_bytes() -> int:
    """MemAvailable: what can be allocated without swapping (free RAM plus the page cache
    that can be dropped); the free pages where /proc/meminfo has no such line."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tier_files_bytes(directory: Path) -> int:
    """The disk space the tier's own record files in `directory` take (allocated blocks:
    a record file is sparse until its records are written). Only those: anything else
    kept there is someone else's and not free."""
    return sum(p.stat().st_blocks * 512 for p in directory.iterdir()
               if p.is_file() and is_disk_records_file(p.name))


def measure_room(directory: Path, num_local_ranks: int) -> NodeRoom:
    """The room at `directory` (an existing one) and in RAM. The tier's record files
    already there count as free: a restart reuses them, so a second launch sizes the
    tier as the first did."""
    free = shutil.disk_usage(directory).free + tier_files_bytes(directory)
    return NodeRoom(directory, free, available_memory_bytes(), max(1, num_local_ranks))


def size_disk_tiers(disk_cache_size: int | None, host_cache_memory: int | None,
                    room: NodeRoom) -> TierSizes:
    """The sizes given, checked against the room; those not given (None), a share of it.
    A size given as 0 turns its tier off, which a disk tier cannot be without: refused."""
    ranks = room.num_local_ranks
    if disk_cache_size is None:
        disk_cache_size = _share("disk", room.free_disk_bytes, DISK_SHARE, ranks,
                                 DISK_MAX_PER_RANK, f"free space at {room.directory}",
                                 "--disk-cache-size")
    elif disk_cache_size <= 0:
        raise ConfigError("--disk-cache-size must be > 0 with --disk-cache-dir (leave it out "
                         "to size the disk tier from the free space)")
    elif disk_cache_size * ranks > room.free_disk_bytes:
        raise ConfigError(f"--disk-cache-size {disk_cache_size} bytes per rank, for {ranks} "
                         f"rank(s) on this node, is more than the {room.free_disk_bytes} "
                         f"bytes free at {room.directory}")
    if host_cache_memory is None:
        host_cache_memory = size_host_tier(room.free_memory_bytes, ranks, required=True)
    elif host_cache_memory <= 0:
        raise ConfigError("the disk tier is fed from the host tier: --host-cache-memory 0 "
                         "turns it off (give it bytes, or leave it out to size it from the "
                         "free RAM)")
    return TierSizes(disk_cache_size, host_cache_memory)


def size_host_tier(free_memory_bytes: int, num_local_ranks: int, *,
                   required: bool = False) -> int:
    """The host tier's default size per rank: a share of the free RAM (logged). Too
    little RAM: refused where the tier is `required` (it feeds the disk tier), else off
    (0, logged)."""
    try:
        return _share("host", free_memory_bytes, HOST_SHARE, max(1, num_local_ranks),
                      HOST_MAX_PER_RANK, "free RAM", "--host-cache-memory")
    except ConfigError as exc:
        if required:
            raise
        log.info("host_tier_off", reason=str(exc))
        return 0


def _share(tier: str, free: int, share: float, ranks: int, cap: int, of_what: str,
           flag: str) -> int:
    """`share` of `free` split among `ranks`, at most `cap`, rounded down to GRANULE;
    refused below MIN_PER_RANK. Logged, with the figures it came from."""
    size = min(int(free * share) // ranks, cap) // GRANULE * GRANULE
    if size < MIN_PER_RANK:
        raise ConfigError(f"the {tier} tier would get {size} bytes per rank ({share:.0%} of "
                         f"the {free} bytes of {of_what}, for {ranks} rank(s)), less than "
                         f"{MIN_PER_RANK}: give {flag} BYTES")
    log.info(f"{tier}_tier_sized", bytes_per_rank=size, share=share, free_bytes=free,
             local_ranks=ranks, capped=size == cap, flag=flag)
    return size
