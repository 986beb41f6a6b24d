"""`--disk-cache-dir` alone: the disk tier and the host tier that feeds it are sized from
what the node has free (orchestrator/tier_sizing.py), on rooms given here, never the
test machine's; what cannot work is refused with its reason."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from orchestrator.config import add_serve_arguments, build_config
from orchestrator.tier_sizing import (
    DISK_MAX_PER_RANK,
    GRANULE,
    HOST_MAX_PER_RANK,
    MIN_PER_RANK,
    NodeRoom,
    TierSizes,
    prepare_disk_dir,
    size_disk_tiers,
    tier_files_bytes,
)
from wire.config import EngineConfig

GiB = 1 << 30


def room(disk: int = 400 * GiB, memory: int = 64 * GiB, ranks: int = 1) -> NodeRoom:
    return NodeRoom(Path("/kv"), free_disk_bytes=disk, free_memory_bytes=memory,
                    num_local_ranks=ranks)


def test_both_sizes_are_a_share_of_the_free_room_per_rank_and_logged() -> None:
    with capture_logs() as logs:
        sizes = size_disk_tiers(None, None, room(disk=400 * GiB, memory=64 * GiB, ranks=4))
    assert sizes == TierSizes(disk_cache_size=50 * GiB,  # half of 400 GiB, over 4 ranks
                              host_cache_memory=int(0.2 * 64 * GiB) // 4 // GRANULE * GRANULE)
    by_event = {e["event"]: e for e in logs}
    assert by_event["disk_tier_sized"]["bytes_per_rank"] == sizes.disk_cache_size
    assert by_event["host_tier_sized"]["bytes_per_rank"] == sizes.host_cache_memory
    assert by_event["disk_tier_sized"]["share"] == 0.5
    assert by_event["host_tier_sized"]["share"] == 0.2
    assert by_event["disk_tier_sized"]["local_ranks"] == 4
    assert by_event["host_tier_sized"]["free_bytes"] == 64 * GiB
    assert not by_event["disk_tier_sized"]["capped"]


def test_sizes_are_rounded_down_so_a_little_less_free_space_changes_nothing() -> None:
    a = size_disk_tiers(None, None, room(disk=100 * GiB + 3 * GRANULE + 12345))
    b = size_disk_tiers(None, None, room(disk=100 * GiB + 2 * GRANULE + 4000))
    assert a.disk_cache_size == b.disk_cache_size == 50 * GiB + GRANULE
    assert a.disk_cache_size % GRANULE == 0 and a.host_cache_memory % GRANULE == 0


def test_a_share_is_bounded() -> None:
    with capture_logs() as logs:
        sizes = size_disk_tiers(None, None, room(disk=100 << 40, memory=4 << 40))
    assert sizes == TierSizes(DISK_MAX_PER_RANK, HOST_MAX_PER_RANK)
    assert all(e["capped"] for e in logs)


@pytest.mark.parametrize("disk, memory, flag", [
    (100 << 20, 64 * GiB, "--disk-cache-size"),  # 50 MiB: too little to be worth a tier
    (400 * GiB, 200 << 20, "--host-cache-memory"),
])
def test_too_little_room_asks_for_a_size(disk: int, memory: int, flag: str) -> None:
    with pytest.raises(ValueError, match=f"less than {MIN_PER_RANK}: give {flag} BYTES"):
        size_disk_tiers(None, None, room(disk=disk, memory=memory))
    # ... which, given, is taken as it is
    assert size_disk_tiers(20 << 20, 30 << 20, room(disk=disk, memory=memory)) == TierSizes(
        20 << 20, 30 << 20)


def test_given_sizes_are_kept_and_only_the_missing_one_is_sized() -> None:
    assert size_disk_tiers(5000, 7000, room()) == TierSizes(5000, 7000)
    only_disk = size_disk_tiers(5000, None, room(memory=10 * GiB))
    assert only_disk == TierSizes(5000, 2 * GiB)
    assert size_disk_tiers(None, 7000, room(disk=10 * GiB)) == TierSizes(5 * GiB, 7000)


def test_what_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="more than the 10737418240 bytes free at /kv"):
        size_disk_tiers(4 * GiB, None, room(disk=10 * GiB, ranks=3))  # 12 GiB in all
    assert size_disk_tiers(3 * GiB, None, room(disk=10 * GiB, ranks=3)).disk_cache_size == (
        3 * GiB)
    with pytest.raises(ValueError, match="--disk-cache-size must be > 0"):
        size_disk_tiers(0, None, room())
    with pytest.raises(ValueError, match="fed from the host tier: --host-cache-memory 0"):
        size_disk_tiers(None, 0, room())


def test_the_directory_is_created_private_or_refused(tmp_path: Path) -> None:
    made = prepare_disk_dir(tmp_path / "a" / "kv")
    assert made == (tmp_path / "a" / "kv").resolve()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot create it"):
        prepare_disk_dir(tmp_path / "file" / "kv")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot create it"):
            prepare_disk_dir(locked / "kv")
        locked.chmod(0o700)


def test_the_tiers_own_files_count_as_free(tmp_path: Path) -> None:
    """A restart measures the room with the tier's file in it: that file is reused, so it
    counts as free, and the second launch sizes the tier as the first did."""
    assert tier_files_bytes(tmp_path) == 0
    with open(tmp_path / "rank0.kv", "wb") as f:
        f.write(b"\1" * (1 << 20))
        f.flush()
        os.fsync(f.fileno())
        f.truncate(1 << 30)  # the rest of the budget: sparse, no space taken yet
    assert (1 << 20) <= tier_files_bytes(tmp_path) < (2 << 20)


def test_other_files_in_the_directory_are_not_free(tmp_path: Path) -> None:
    """A directory that holds other things too: only the tier's record files are its own
    (a folder of 300 GB of checkpoints must not size a tier past the real free space)."""
    for name in ("checkpoint.bin", "rank0.kv.bak", "rankA.kv", "identity-rank0.json"):
        (tmp_path / name).write_bytes(b"\1" * (1 << 20))
    assert tier_files_bytes(tmp_path) == 0
    (tmp_path / "rank12.kv").write_bytes(b"\1" * (1 << 20))
    assert (1 << 20) <= tier_files_bytes(tmp_path) < (2 << 20)


def test_a_hybrid_models_snapshot_records_are_the_tiers_own_too(tmp_path: Path) -> None:
    """Its state snapshots' records (worker/disk_store.py kind "state") share the budget."""
    for name in ("rank0.state.bak", "rankA.state", "identity-state-rank0.json"):
        (tmp_path / name).write_bytes(b"\1" * (1 << 20))
    assert tier_files_bytes(tmp_path) == 0
    (tmp_path / "rank0.state").write_bytes(b"\1" * (1 << 20))
    (tmp_path / "rank0.kv").write_bytes(b"\1" * (1 << 20))
    assert (2 << 20) <= tier_files_bytes(tmp_path) < (3 << 20)


# --- through the command line -----------------------------------------------------------


def engine_config(*argv: str, local_ranks: int = 1, free: NodeRoom | None = None,
                  ) -> tuple[EngineConfig, list[tuple[Path, int]]]:
    """build_config on `argv`, the room it measures being `free`'s figures; the config and
    the (directory, ranks) it measured."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    asked: list[tuple[Path, int]] = []

    def measure(directory: Path, ranks: int) -> NodeRoom:
        asked.append((directory, ranks))
        base = free or room()
        return NodeRoom(directory, base.free_disk_bytes, base.free_memory_bytes, ranks)

    config = build_config(p.parse_args(list(argv)), world_size=4, num_local_ranks=local_ranks,
                          measure=measure)[0]
    return config, asked


def test_disk_cache_dir_alone_gets_a_disk_tier(default_model: Path, tmp_path: Path) -> None:
    config, asked = engine_config("--model", str(default_model), "--disk-cache-dir",
                                  str(tmp_path / "kv"), local_ranks=2,
                                  free=room(disk=200 * GiB, memory=20 * GiB))
    assert asked == [((tmp_path / "kv").resolve(), 2)]  # this node's ranks share the room
    assert config.disk_cache_dir == str((tmp_path / "kv").resolve())
    assert config.disk_cache_size == 50 * GiB  # half of 200 GiB, over 2 ranks
    assert config.host_cache_memory == 2 * GiB  # a fifth of 20 GiB, over 2 ranks
    assert config.kv_write_policy == "write_through"
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


def test_without_a_disk_tier_nothing_is_measured_or_sized(default_model: Path) -> None:
    config, asked = engine_config("--model", str(default_model))
    assert asked == [] and (config.disk_cache_size, config.host_cache_memory) == (0, 0)
    config, asked = engine_config("--model", str(default_model), "--host-cache-memory", "9")
    assert asked == [] and config.host_cache_memory == 9


def test_the_command_line_refuses_what_cannot_work(default_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="more than the"):
        engine_config("--model", str(default_model), "--disk-cache-dir", str(tmp_path / "kv"),
                      "--disk-cache-size", str(8 * GiB), local_ranks=2, free=room(disk=10 * GiB))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot create it"):
        engine_config("--model", str(default_model), "--disk-cache-dir",
                      str(tmp_path / "file" / "kv"))


def test_on_gpus_the_host_tier_is_on_by_default(default_model: Path, monkeypatch) -> None:
    """On a GPU node the host tier is another memory: a fifth of the free RAM, split among
    the node's ranks. On CPU it would be the device tier's own memory: off."""
    monkeypatch.setattr("orchestrator.config.available_memory_bytes", lambda: 40 * GiB)
    config, asked = engine_config("--model", str(default_model), "--device", "cuda",
                                  local_ranks=4)
    assert asked == [] and config.host_cache_memory == 2 * GiB
    config, _ = engine_config("--model", str(default_model), "--device", "cuda",
                              "--host-cache-memory", "0")
    assert config.host_cache_memory == 0  # asked for off
    config, _ = engine_config("--model", str(default_model), "--device", "cpu")
    assert config.host_cache_memory == 0
    monkeypatch.setattr("orchestrator.config.available_memory_bytes", lambda: 1 << 20)
    config, _ = engine_config("--model", str(default_model), "--device", "cuda")
    assert config.host_cache_memory == 0  # too little RAM for a tier: off, not refused
