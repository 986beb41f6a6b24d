"""worker/main.py `_next_message`: under overlap scheduling a rank waits for the next plan
while its forward runs (it comes a little after the launch), and stops waiting when the
forward ends. Fakes stand in for the socket and the runner: a GPU's end is looked at
between polls, the null model's is known."""

from __future__ import annotations

from types import SimpleNamespace

from wire import codec
from wire.step import StepPlan
from worker import main as worker_main


class Socket:
    def __init__(self, ready_at_poll: int | None) -> None:
        self.ready_at_poll = ready_at_poll  # the poll (0-based) that finds the plan
        self.polls: list[int] = []

    def poll(self, timeout_ms: int) -> bool:
        self.polls.append(timeout_ms)
        return self.ready_at_poll is not None and len(self.polls) > self.ready_at_poll

    def recv(self) -> bytes:
        return codec.encode(StepPlan(step=7))


class Runner:
    """A GPU's forward (no known end) that ends at the `done_at`-th look."""

    def __init__(self, done_at: int, busy_s: float = 0.0, async_scheduling: bool = True):
        self.config = SimpleNamespace(async_scheduling=async_scheduling)
        self.done_at, self.looks, self._busy = done_at, 0, busy_s

    def forward_in_flight(self) -> bool:
        return True

    def busy_s(self) -> float:
        return self._busy

    def forward_done(self) -> bool:
        self.looks += 1
        return self.looks >= self.done_at


def test_a_plan_that_comes_during_the_forward_is_taken(monkeypatch):
    monkeypatch.setattr(worker_main, "LOOK_S", 0.0)
    sock, runner = Socket(ready_at_poll=3), Runner(done_at=10)
    msg, _ = worker_main._next_message(sock, runner)
    assert isinstance(msg, StepPlan) and msg.step == 7
    assert sock.polls == [0, 0, 0, 0]  # a GPU: the socket looked at between the device's
    assert runner.looks == 3


def test_the_wait_ends_with_the_forward(monkeypatch):
    monkeypatch.setattr(worker_main, "LOOK_S", 0.0)
    sock, runner = Socket(ready_at_poll=None), Runner(done_at=4)
    assert worker_main._next_message(sock, runner) == (None, 0.0)
    assert len(sock.polls) == 4 and runner.looks == 4


def test_the_null_models_forward_is_waited_out_in_one_poll():
    sock, runner = Socket(ready_at_poll=None), Runner(done_at=1, busy_s=0.0042)
    assert worker_main._next_message(sock, runner) == (None, 0.0)
    assert sock.polls == [5]  # its remaining 4.2 ms, rounded up


def test_without_overlap_nothing_is_waited_for():
    sock, runner = Socket(ready_at_poll=0), Runner(done_at=1, async_scheduling=False)
    assert worker_main._next_message(sock, runner) == (None, 0.0)
    assert sock.polls == []
