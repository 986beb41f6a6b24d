"""How the scheduler reaches its ranks: one small interface, two implementations.

`ZmqExecutor` talks to worker processes over ZeroMQ (ROUTER here, one DEALER per
rank). Tests and the simulator implement the same methods in-process.

A plan is `submit`ted, and its results `collect`ed later, in submission order: with
overlap scheduling (scheduler/engine.py) the engine submits step k+1 before it collects
step k, so each rank finds its next plan queued on its socket when it finishes a step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import zmq

from scheduler.rank_health import (
    RankProcess,
    dead_ranks,
    describe_dead,
    describe_ranks,
    hung_ranks,
)
from wire import codec
from wire.config import EngineConfig
from wire.lifecycle import Shutdown, StartFailed, WorkerConnect, WorkerReady
from wire.security import secure_bind
from wire.step import StepPlan, StepResult
from wire.step_channel import SchedulerChannel, supported


def choose_channel(config: EngineConfig, address: str) -> str:
    """The step channel for ranks at `address`: "auto" takes shared memory where it can
    serve them (every rank on this host, x86-64), ZeroMQ elsewhere."""
    why = supported(address)
    if config.step_channel == "auto":
        return "shm" if why is None else "zmq"
    if config.step_channel == "shm" and why is not None:
        raise ValueError(f"step_channel 'shm' is not for {address}: {why}")
    return config.step_channel


class Executor(Protocol):
    def start(self) -> list[WorkerReady]:
        """Bring the ranks up; one WorkerReady per rank, in rank order."""

    def submit(self, plan: StepPlan) -> None:
        """Send one plan to every rank; it runs after every plan submitted before it."""

    def collect(self) -> list[StepResult]:
        """The oldest submitted plan's results: one StepResult per rank, in rank order."""

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Run one plan on every rank (submit, then collect)."""

    def shutdown(self) -> None: ...


@dataclass
class ExchangeTiming:
    """The scheduler's side of one step's exchange with the ranks, in seconds: with the
    ranks' own `RankTiming` it splits a step into encoding, transport, the ranks' work
    and waiting (scheduler/engine.py StepTotals). In-process executors have none."""

    encode_s: float = 0.0  # the plan to msgpack, once for every rank
    # the frame handed to ZeroMQ, once per rank (part of wait_s and of the round trips)
    send_s: float = 0.0
    decode_s: float = 0.0  # the ranks' results from msgpack (part of wait_s)
    round_trip_s: list[float] = field(default_factory=list)  # per rank: its send -> result in
    wait_s: float = 0.0  # the sends, and from collecting to the last result decoded


@dataclass
class _Submitted:
    step: int
    encode_s: float
    send_s: float
    sent: list[float]  # per rank, perf_counter before its send


class WorkerFailure(RuntimeError):
    """A rank died, reported an error, or did not answer in time.

    `ranks` are the ranks to blame; `cause` is "died", "hung" or "error"."""

    def __init__(self, message: str, ranks: list[int] | None = None,
                 cause: str = "error") -> None:
        super().__init__(message)
        self.ranks = ranks or []
        self.cause = cause


# How often, while waiting for the ranks, the executor checks that their processes live:
# a dead rank is reported within this, not after the step timeout.
POLL_SLICE_S = 0.5
# A rank's error may be the echo of a peer's death (gloo: "connection closed by peer");
# this long is given to the dead peer's process to show as dead before the messenger is
# blamed.
DEATH_GRACE_S = 0.5


class ZmqExecutor:
    def __init__(self, address: str, config: EngineConfig, start_timeout_s: float = 600,
                 step_timeout_s: float | None = None, control_dir: Path | None = None) -> None:
        self.address = address
        self.config = config  # sent to the ranks, with the step channel chosen (`start`)
        self.world_size = config.world_size
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s or config.step_timeout_s  # None: the config's
        self.control_dir = control_dir  # where the ranks' control sockets are (hang checks)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_bind(self._sock, address)  # CURVE over tcp://, a 0600 file over ipc://
        # the steps through shared memory (wire/step_channel.py), when chosen: made in
        # `start`, before any rank has the configuration (a rank opens it then)
        self._channel: SchedulerChannel | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._results: deque[bytes] = deque()  # taken from the channel, not yet handed out
        self._identities: list[bytes] = []
        self._procs: dict[int, RankProcess] = {}
        self.last_exchange = ExchangeTiming()  # of the last step (EngineCore reads it)
        self._submitted: deque[_Submitted] = deque()
        # results of a later step that came in while an earlier one was collected:
        # step -> rank -> (result, perf_counter at arrival)
        self._early: dict[int, dict[int, tuple[StepResult, float]]] = {}

    def _recv(self, deadline: float, during: str) -> tuple[bytes, bytes] | None:
        """The next (identity, frame), or None at the deadline; a result from the step
        channel has no identity (b""). Between poll slices, a rank process that died
        raises WorkerFailure at once."""
        while True:
            if self._channel is not None and not self._results:
                self._results.extend(self._channel.take_results())
            if self._results:
                return b"", self._results.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready = dict(self._poller.poll(max(1, int(min(remaining, POLL_SLICE_S) * 1000))))
            if self._sock in ready:
                identity, frame = self._sock.recv_multipart()
                return identity, frame
            if not ready:
                self.check_alive(during)

    def check_alive(self, during: str) -> None:
        """Raise WorkerFailure naming every rank on this host whose process is gone."""
        dead = dead_ranks(list(self._procs.values()))
        if dead:
            raise WorkerFailure(f"{describe_dead(dead)} died {during}",
                                [r.rank for r in dead], "died")

    def _rank_error(self, rank: int, during: str, error: str) -> WorkerFailure:
        """A rank's error, unless a dead peer caused it: then the dead one is named."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            try:
                self.check_alive(during)
            except WorkerFailure as exc:
                return WorkerFailure(f"{exc} (rank {rank} reported: {error})", exc.ranks,
                                     exc.cause)
            if time.monotonic() >= deadline:
                return WorkerFailure(f"rank {rank} failed {during}: {error}", [rank])
            time.sleep(0.05)

    def start(self) -> list[WorkerReady]:
        """Each rank connects (and is sent the config), then loads the model and says it
        is ready. A fast rank may be ready before a slow one has connected: one loop
        takes both kinds of message in any order."""
        self._open_channel()
        try:
            return self._start()
        finally:  # every rank opened the step channel before it said it was ready
            if self._channel is not None:
                self._channel.unlink()

    def _open_channel(self) -> None:
        """The step channel the ranks will be told of: shared memory where it can serve
        them ("auto" falls back to ZeroMQ where it cannot be made, e.g. /dev/shm full)."""
        channel = choose_channel(self.config, self.address)
        if channel == "shm":
            try:
                self._channel = SchedulerChannel(self.address, self.world_size)
                self._poller.register(self._channel.results_fd, zmq.POLLIN)
            except OSError:
                if self.config.step_channel == "shm":
                    raise
                channel = "zmq"
        self.config = replace(self.config, step_channel=channel)

    def _start(self) -> list[WorkerReady]:
        deadline = time.monotonic() + self.start_timeout_s
        identities: dict[int, bytes] = {}
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.world_size:
            connecting = len(identities) < self.world_size
            got = self._recv(deadline, "while connecting" if connecting
                             else "while loading the model")
            if got is None:
                raise self._start_timeout("connect" if connecting else "model load")
            identity, msg = got[0], codec.decode(got[1])
            if isinstance(msg, StartFailed):
                raise self._rank_error(msg.rank, "while loading the model", msg.error)
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
                continue
            assert isinstance(msg, WorkerConnect), msg
            if msg.world_size != self.world_size:
                raise WorkerFailure(
                    f"rank {msg.rank} has WORLD_SIZE={msg.world_size}, engine has "
                    f"{self.world_size}", [msg.rank])
            identities[msg.rank] = identity
            self._procs[msg.rank] = RankProcess(msg.rank, msg.pid, msg.host_id)
            self._sock.send_multipart([identity, codec.encode(self.config)])
        self._identities = [identities[r] for r in range(self.world_size)]
        return [ready[r] for r in range(self.world_size)]

    def _start_timeout(self, waiting_for: str) -> WorkerFailure:
        return WorkerFailure(f"no answer from the ranks within {self.start_timeout_s:.0f}s "
                             f"({waiting_for})", cause="hung")

    def submit(self, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        frame = codec.encode(plan)
        t1 = time.perf_counter()
        # a rank's round trip starts before its send: on a busy machine the woken rank may
        # run (and answer) while this thread is still inside send_multipart
        if self._channel is not None:
            # results taken first: one a rank sent over the socket (too large for its slot)
            # may have been collected while its slot's mark was not yet taken
            self._results.extend(self._channel.take_results())
            sent = [time.perf_counter()] * self.world_size
            self._channel.post(frame, self._send_to_all)
        else:
            sent = self._send_to_all(frame)
        self._submitted.append(_Submitted(plan.step, t1 - t0, time.perf_counter() - t1, sent))

    def collect(self) -> list[StepResult]:
        """Under overlap a rank may answer the next step before another rank answers this
        one: such results wait in `_early` for their own collect."""
        sub = self._submitted.popleft()
        t0 = time.perf_counter()
        results = self._early.pop(sub.step, {})
        decode_s = 0.0
        deadline = time.monotonic() + self.step_timeout_s
        during = f"during step {sub.step}"
        while len(results) < self.world_size:
            got = self._recv(deadline, during)
            if got is None:
                raise self._hung(sub.step, sorted(set(range(self.world_size)) - set(results)))
            t = time.perf_counter()
            msg = codec.decode(got[1])
            decode_s += time.perf_counter() - t
            assert isinstance(msg, StepResult), msg
            if msg.error:
                raise self._rank_error(msg.rank, f"during step {msg.step}", msg.error)
            if msg.step == sub.step:
                results[msg.rank] = (msg, t)
            else:
                assert msg.step > sub.step, f"rank {msg.rank} answered step {msg.step} twice"
                self._early.setdefault(msg.step, {})[msg.rank] = (msg, t)
        self.last_exchange = ExchangeTiming(
            encode_s=sub.encode_s, send_s=sub.send_s, decode_s=decode_s,
            round_trip_s=[results[r][1] - s for r, s in enumerate(sub.sent)],
            wait_s=sub.send_s + time.perf_counter() - t0)
        return [results[r][0] for r in range(self.world_size)]

    def _send_to_all(self, frame: bytes) -> list[float]:
        """`frame` to every rank over the socket; perf_counter before each send."""
        sent = []
        for identity in self._identities:
            sent.append(time.perf_counter())
            self._sock.send_multipart([identity, frame])
        return sent

    def step(self, plan: StepPlan) -> list[StepResult]:
        self.submit(plan)
        return self.collect()

    def _hung(self, step: int, missing: list[int]) -> WorkerFailure:
        procs = [self._procs.get(r, RankProcess(r, 0, "")) for r in missing]
        hung, waiting = hung_ranks(procs, self.control_dir)
        message = (f"{describe_ranks(hung)} did not answer step {step} within "
                   f"{self.step_timeout_s:g}s: hung")
        if waiting:
            message += f" ({describe_ranks(waiting)} waiting in a collective)"
        return WorkerFailure(message, hung, "hung")

    def shutdown(self) -> None:
        self._send_to_all(codec.encode(Shutdown("engine stopping")))
        self._sock.close(linger=200)
        if self._channel is not None:
            self._channel.close()
