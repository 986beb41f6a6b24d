"""Rank identity and the tensor-parallel process group.

A worker reads the standard torchrun variables, so it can be started by our
launcher or by `torchrun` itself. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> RankInfo:
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise RuntimeError(f"worker needs the torchrun variables; missing {missing}")
        world_size = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )


def set_torch_threads(local_world_size: int, requested: int = 0) -> int:
    """Give each rank its share of the cores so N ranks do not fight over them."""
    threads = requested or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


class TensorParallelGroup:
    """The collectives the model needs; no-ops at world size 1.

    `collective_since` (monotonic seconds, 0 when not in one) marks a rank blocked in a
    collective, read by its control thread: when a step hangs, the ranks waiting in a
    collective are the victims and the one that is not is the culprit. (With NCCL the
    calls return at once and the wait happens at the next sync, so there it marks little.)
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.collective_since = 0.0

    @contextmanager
    def _collective(self) -> Iterator[None]:
        self.collective_since = time.monotonic()
        try:
            yield
        finally:
            self.collective_since = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            with self._collective():
                dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor, everywhere: bool = False) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dim: on rank 0 only, or with
        `everywhere` on every rank (an all-gather: the logits every rank samples from
        under overlap scheduling, worker/model_runner.py)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if everywhere:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            with self._collective():
                dist.all_gather(parts, x)
            return torch.cat(parts, dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        with self._collective():
            dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_agree(self, values: torch.Tensor) -> torch.Tensor:
        """bool per element: the same int64 value on every rank (min == max). The disk
        tier's warm restart keeps the slots every rank holds with the same hash."""
        if self.world_size == 1:
            return torch.ones(values.shape, dtype=torch.bool)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        lo, hi = values.to(device).clone(), values.to(device).clone()
        with self._collective():
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return (lo == hi).cpu()

    def all_min(self, value: int) -> int:
        """The minimum of an integer across ranks (block counts are agreed this way)."""
        return self._all_reduce_int(value, dist.ReduceOp.MIN)

    def all_max(self, value: int) -> int:
        """The maximum of an integer across ranks (the automatic snapshot interval)."""
        return self._all_reduce_int(value, dist.ReduceOp.MAX)

    def _all_reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        with self._collective():
            dist.all_reduce(t, op=op)
        return int(t.item())


def init_tensor_parallel(info: RankInfo, device: torch.device) -> TensorParallelGroup:
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=120),
            device_id=device if device.type == "cuda" else None,
        )
    return TensorParallelGroup(info.rank, info.world_size)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def shutdown_tensor_parallel() -> None:
    """Tear the process group down before exit: left to interpreter shutdown, gloo's
    threads can be destroyed while joinable and abort the process (SIGABRT)."""
    if dist.is_initialized():
        dist.destroy_process_group()
