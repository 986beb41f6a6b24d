"""How the executor tells a dead rank from a hung one, against fake ranks (threads with a
DEALER socket each, standing for processes whose pids are real child processes here)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq

from scheduler.executor import WorkerFailure, ZmqExecutor
from scheduler.rank_health import RankProcess, host_identity, hung_ranks, pid_alive
from wire import codec, step_channel
from wire.config import EngineConfig
from wire.control import RankSnapshot
from wire.control_server import ControlServer, control_address
from wire.lifecycle import EngineLimits, WorkerConnect, WorkerReady
from wire.step import StepPlan, StepResult
from wire.step_channel import RankChannel


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_pid_alive_treats_zombies_as_dead() -> None:
    assert pid_alive(os.getpid())
    proc = sleeper()
    assert pid_alive(proc.pid)
    proc.kill()
    deadline = time.monotonic() + 5
    while pid_alive(proc.pid):  # a zombie until reaped below: already dead
        assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
        time.sleep(0.01)
    assert Path(f"/proc/{proc.pid}").exists(), "expected a zombie (not reaped yet)"
    proc.wait()
    assert not pid_alive(proc.pid)


class FakeRank(threading.Thread):
    """Connects like worker/main.py, then answers each step unless `silent`, or
    reports `error` instead."""

    def __init__(self, address: str, rank: int, pid: int, silent: bool = False,
                 error: str | None = None) -> None:
        super().__init__(daemon=True)
        self.address, self.rank, self.pid = address, rank, pid
        self.silent, self.error = silent, error
        self.stop = threading.Event()

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        sock.send(codec.encode(WorkerConnect(self.rank, 2, self.pid, host_identity())))
        config = codec.decode(sock.recv())
        assert isinstance(config, EngineConfig)
        limits = EngineLimits(100, 64, (1,), 8, 0, 1024)
        link = RankChannel(self.address, self.rank, 2, sock) \
            if config.step_channel == "shm" else sock  # the steps' way, as worker/main.py's
        sock.send(codec.encode(WorkerReady(self.rank, "cpu", limits)))
        while not self.stop.is_set():
            if not link.poll(50):
                continue
            plan = codec.decode(link.recv())
            if isinstance(plan, StepPlan) and not self.silent:
                link.send(codec.encode(StepResult(plan.step, self.rank, 0, error=self.error)))
        sock.close()


@pytest.fixture(params=["zmq", "shm"])
def engine(tmp_path: Path, request):
    """An executor and two fake ranks; rank 1's process is a `sleep` the test may kill.
    Steps over the ZeroMQ socket, and again over the shared-memory step channel."""
    procs = [sleeper(), sleeper()]
    executors: list[ZmqExecutor] = []
    ranks: list[FakeRank] = []

    def make(step_timeout_s: float = 30, **rank1: object) -> tuple[ZmqExecutor, list]:
        address = f"ipc://{tmp_path}/workers.sock"
        executor = ZmqExecutor(address, EngineConfig(model="m", world_size=2,
                                                     step_channel=request.param),
                               start_timeout_s=10, step_timeout_s=step_timeout_s)
        executors.append(executor)
        ranks.extend([FakeRank(address, 0, procs[0].pid, error=rank1.pop("error0", None)),
                      FakeRank(address, 1, procs[1].pid, **rank1)])
        for r in ranks:
            r.start()
        executor.start()
        return executor, procs

    yield make
    for r in ranks:
        r.stop.set()
    for p in procs:
        p.kill()
        p.wait()
    for e in executors:
        e.shutdown()


def test_a_dead_rank_is_named_within_a_poll_slice(engine) -> None:
    executor, procs = engine(silent=True)
    procs[1].kill()  # not reaped: a zombie, as a rank is until the launcher polls
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        executor.step(StepPlan(step=7))
    assert time.monotonic() - t0 < 2  # not the 30 s step timeout
    assert str(info.value) == f"rank 1 (pid {procs[1].pid}) died during step 7"
    assert (info.value.ranks, info.value.cause) == ([1], "died")


def test_an_error_caused_by_a_dead_peer_names_the_dead_rank(engine) -> None:
    executor, procs = engine(silent=True, error0="RuntimeError: Connection closed by peer")
    procs[1].kill()
    with pytest.raises(WorkerFailure) as info:
        executor.step(StepPlan(step=3))
    msg = str(info.value)
    assert msg.startswith(f"rank 1 (pid {procs[1].pid}) died during step 3")
    assert "rank 0 reported: RuntimeError: Connection closed by peer" in msg
    assert info.value.ranks == [1]


def test_an_error_of_a_live_rank_names_it(engine) -> None:
    executor, _ = engine(error="ValueError: bad plan")
    with pytest.raises(WorkerFailure, match="rank 1 failed during step 2: ValueError") as info:
        executor.step(StepPlan(step=2))
    assert (info.value.ranks, info.value.cause) == ([1], "error")


def test_a_silent_live_rank_is_hung_after_the_step_timeout(engine) -> None:
    executor, _ = engine(step_timeout_s=0.6, silent=True)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        executor.step(StepPlan(step=1))
    assert 0.5 < time.monotonic() - t0 < 3
    assert str(info.value) == "rank 1 did not answer step 1 within 0.6s: hung"
    assert (info.value.ranks, info.value.cause) == ([1], "hung")


def test_the_ranks_waiting_in_a_collective_are_not_blamed(tmp_path: Path) -> None:
    """Both ranks are silent (rank 0 waits for rank 1 in an all-reduce): their control
    sockets tell which one is stuck elsewhere."""

    def snapshot(rank: int, in_collective: float):
        return lambda req: RankSnapshot(rank, os.getpid(), "cpu", 3, 5, "forward", 0.0, 4.0,
                                        0, seconds_in_collective=in_collective)

    servers = [ControlServer(control_address(tmp_path, "rank0"), snapshot(0, 3.9)).start(),
               ControlServer(control_address(tmp_path, "rank1"), snapshot(1, 0.0)).start()]
    try:
        here = host_identity()
        procs = [RankProcess(r, os.getpid(), here) for r in range(3)]  # rank 2: no socket
        assert hung_ranks(procs, tmp_path) == ([1, 2], [0])
        assert hung_ranks(procs[:1], tmp_path) == ([0], [])  # all waiting: no one to tell
        assert hung_ranks(procs, None) == ([0, 1, 2], [])
    finally:
        for s in servers:
            s.close()


def test_results_too_large_for_their_slots_come_over_the_socket(engine, monkeypatch) -> None:
    """Over the step channel a result that does not fit its slot goes over the socket;
    with two plans in flight (overlap), the next post must still find every slot
    answered (ZmqExecutor.submit takes the slots' marks first)."""
    monkeypatch.setattr(step_channel, "RESULT_SLOT_BYTES", 64)  # every result: the socket
    executor, _ = engine()
    executor.submit(StepPlan(step=0))
    executor.submit(StepPlan(step=1))
    for step in range(2, 8):
        assert [r.step for r in executor.collect()] == [step - 2] * 2
        executor.submit(StepPlan(step=step))
    assert [r.step for r in executor.collect()] == [6, 6]
    assert [r.step for r in executor.collect()] == [7, 7]
