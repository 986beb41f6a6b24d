"""How the scheduler reaches its ranks: one small interface, two implementations.

`ZmqExecutor` talks to worker processes over ZeroMQ (ROUTER here, one DEALER per
rank). Tests and the simulator implement the same three methods in-process.
"""

from __future__ import annotations

import time
from typing import Protocol

import zmq

from scheduler.protocol import (
    EngineConfig,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerConnect,
    WorkerReady,
    codec,
)
from scheduler.protocol.transport_security import secure_bind


class Executor(Protocol):
    def start(self) -> list[WorkerReady]:
        """Bring the ranks up; one WorkerReady per rank, in rank order."""

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Run one plan on every rank; one StepResult per rank, in rank order."""

    def shutdown(self) -> None: ...


class WorkerFailure(RuntimeError):
    """A rank reported an error, or did not answer in time."""


class ZmqExecutor:
    def __init__(self, address: str, config: EngineConfig, start_timeout_s: float = 600,
                 step_timeout_s: float = 600) -> None:
        self.config = config
        self.world_size = config.world_size
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_bind(self._sock, address)  # CURVE over tcp://, a 0600 file over ipc://
        self._identities: list[bytes] = []

    def _recv(self, timeout_s: float, waiting_for: str) -> tuple[bytes, object]:
        if not self._sock.poll(max(1, int(timeout_s * 1000))):
            raise WorkerFailure(f"no answer from the ranks within {timeout_s:.0f}s ({waiting_for})")
        identity, frame = self._sock.recv_multipart()
        return identity, codec.decode(frame)

    def start(self) -> list[WorkerReady]:
        deadline = time.monotonic() + self.start_timeout_s
        identities: dict[int, bytes] = {}
        while len(identities) < self.world_size:
            identity, msg = self._recv(deadline - time.monotonic(), "connect")
            assert isinstance(msg, WorkerConnect), msg
            if msg.world_size != self.world_size:
                raise WorkerFailure(
                    f"rank {msg.rank} has WORLD_SIZE={msg.world_size}, engine has "
                    f"{self.world_size}")
            identities[msg.rank] = identity
            self._sock.send_multipart([identity, codec.encode(self.config)])
        self._identities = [identities[r] for r in range(self.world_size)]
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.world_size:
            _, msg = self._recv(deadline - time.monotonic(), "model load")
            if isinstance(msg, StepResult) and msg.error:
                raise WorkerFailure(f"rank {msg.rank} failed to start: {msg.error}")
            assert isinstance(msg, WorkerReady), msg
            ready[msg.rank] = msg
        return [ready[r] for r in range(self.world_size)]

    def step(self, plan: StepPlan) -> list[StepResult]:
        frame = codec.encode(plan)
        for identity in self._identities:
            self._sock.send_multipart([identity, frame])
        results: dict[int, StepResult] = {}
        deadline = time.monotonic() + self.step_timeout_s
        while len(results) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(results))
            _, msg = self._recv(deadline - time.monotonic(),
                                f"step {plan.step}, ranks {missing}")
            assert isinstance(msg, StepResult), msg
            if msg.error:
                raise WorkerFailure(f"rank {msg.rank} failed in step {msg.step}: {msg.error}")
            results[msg.rank] = msg
        return [results[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        for identity in self._identities:
            self._sock.send_multipart([identity, codec.encode(Shutdown("engine stopping"))])
        self._sock.close(linger=200)
