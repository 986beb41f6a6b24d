"""Rank processes on this machine for the benchmarks that drive the engine without the
launcher: torchrun's variables, a free loopback port, quiet logs."""

from __future__ import annotations

from orchestrator.launcher import Child, free_port, spawn


def spawn_local_ranks(address: str, world_size: int) -> list[Child]:
    """`world_size` worker ranks connecting to the scheduler at `address`."""
    port = str(free_port())
    return [spawn(f"rank {r}", ["worker.main", "--scheduler", address], {
        "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port, "DEEPINFER_LOG_LEVEL": "WARNING"}) for r in range(world_size)]
