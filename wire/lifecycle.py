"""Hellos, readiness and goodbyes: how a rank and the shim join the scheduler, and leave.

    rank -> scheduler    WorkerConnect; then WorkerReady (or the error it failed with)
    scheduler -> rank    EngineConfig (wire/config.py), then step plans, then Shutdown
    shim -> scheduler    ClientHello
    scheduler -> shim    EngineInfo; Shutdown when the engine goes away
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
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


@dataclass
class WorkerReady:
    """A rank has loaded its shard and allocated its KV tiers (counts agreed across ranks)."""

    rank: int
    device: str
    num_device_blocks: int
    num_host_blocks: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    kv_bytes_per_block: int


@dataclass
class ClientHello:
    """The shim's first message; the scheduler answers with EngineInfo."""

    pid: int


@dataclass
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    world_size: int


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
