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
    assert sock.polls == [4]  # its remaining 4.2 ms, whole; the rest looked at


def test_without_overlap_nothing_is_waited_for():
    sock, runner = Socket(ready_at_poll=0), Runner(done_at=1, async_scheduling=False)
    assert worker_main._next_message(sock, runner) == (None, 0.0)
    assert sock.polls == []


def null_runner(default_model, forward_ms: float):
    import torch

    from tests.conftest import fitting_max_model_len
    from wire.config import EngineConfig
    from wire.step import NewSequence, ScheduledChunk
    from worker.distributed import TensorParallelGroup
    from worker.model_runner import ModelRunner

    config = EngineConfig(model=str(default_model), null_model_forward_ms=forward_ms,
                          kv_cache_memory=8 << 20,
                          max_model_len=fitting_max_model_len(default_model, 8 << 20))
    runner = ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"))
    step = runner.prepare(StepPlan(0, new_seqs=[NewSequence(1, [0])],
                                   chunks=[ScheduledChunk(1, [11, 12, 13], 0, True)]))
    runner.launch(step)  # its forward now runs for forward_ms
    return runner, step


def test_a_null_model_rank_takes_a_plan_or_a_shutdown_sent_during_its_forward(default_model):
    import threading
    import time

    import zmq

    from wire.lifecycle import Shutdown

    ctx = zmq.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://next-message")
    theirs.connect("inproc://next-message")
    try:
        for message in (StepPlan(step=1), Shutdown(reason="test"), None):
            runner, step = null_runner(default_model, forward_ms=200)
            if message is not None:  # sent 20 ms into the 200 ms forward
                threading.Timer(0.02, theirs.send, [codec.encode(message)]).start()
            got, _ = worker_main._next_message(ours, runner)
            if message is None:  # nothing came: waited out to the forward's end
                assert got is None and runner.forward_done()
            else:
                assert type(got) is type(message) and not runner.forward_done()
            runner.finish(step)
            time.sleep(0.03)  # a late timer's message would show in the next round
    finally:
        ours.close(linger=0)
        theirs.close(linger=0)
        ctx.term()
