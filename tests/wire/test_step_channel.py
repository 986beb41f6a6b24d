"""The shared-memory step channel (wire/step_channel.py), both ends in this process: plans
to two ranks and results back, in order through the two slots, and the frames too large
for a slot over the ZeroMQ socket, in their place in the order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from wire import step_channel
from wire.step_channel import RankChannel, SchedulerChannel, supported


@pytest.fixture
def channel(tmp_path: Path):
    """A scheduler end and two rank ends over one ROUTER and two DEALERs (ipc://)."""
    address = f"ipc://{tmp_path}/workers.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    sched = SchedulerChannel(address, 2)
    dealers, ranks = [], []
    for r in range(2):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, f"rank-{r}".encode())
        d.connect(address)
        d.send(b"hello")
        dealers.append(d)
        ranks.append(RankChannel(address, r, 2, d))
    identities = [router.recv_multipart()[0] for _ in range(2)]
    sched.unlink()  # both ends mapped it: the name can go, the mapping stays
    assert not step_channel._paths(address, 2)[0].exists()

    def send_over_socket(frame: bytes) -> None:
        for identity in identities:
            router.send_multipart([identity, frame])

    yield sched, ranks, router, send_over_socket
    sched.close()
    for s in (router, *dealers):
        s.close(linger=0)
    ctx.term()


def test_plans_and_results_go_round_in_order(channel):
    sched, ranks, _, send = channel
    for n in range(7):  # past both slots several times, two plans in flight as overlap does
        sched.post(b"plan %d" % n, send)
        if n == 0:
            continue
        for rank in ranks:  # plan n - 1, then n, are there
            assert rank.poll(0)
            plan = rank.recv()
            assert plan == b"plan %d" % (n - 1)
            rank.send(b"result %d of rank %d" % (n - 1, rank.rank))
        assert sched.take_results() == [b"result %d of rank 0" % (n - 1),
                                         b"result %d of rank 1" % (n - 1)]
        assert sched.take_results() == []


def test_a_frame_too_large_for_its_slot_comes_over_the_socket(channel):
    sched, ranks, router, send = channel
    big = b"x" * step_channel.PLAN_SLOT_BYTES
    sched.post(b"small", send)
    sched.post(big, send)  # two in flight, as overlap allows
    for rank in ranks:
        assert [rank.recv() for _ in range(2)] == [b"small", big]
    with pytest.raises(AssertionError, match="before every result 0"):
        sched.post(b"too soon", send)  # plan 0's slot: not answered yet
    for rank in ranks:
        rank.send(b"result 0")
    assert sched.take_results() == [b"result 0"] * 2
    sched.post(b"after", send)
    for rank in ranks:
        assert rank.recv() == b"after"
    # a rank's result too large for its slot: over the socket, not among the slot's
    huge = b"r" * step_channel.RESULT_SLOT_BYTES
    ranks[1].send(b"fits")
    ranks[1].send(huge)
    assert sched.take_results() == [b"fits"]
    assert router.poll(2000) and router.recv_multipart()[1] == huge


def test_a_rank_waits_for_its_plan_and_sees_a_message_on_the_socket(channel):
    sched, ranks, router, send = channel
    assert not ranks[0].poll(10)
    router.send_multipart([b"rank-0", b"shutdown"])  # e.g. a Shutdown: over the socket
    assert ranks[0].poll(2000) and ranks[0].recv() == b"shutdown"
    sched.post(b"plan 0", send)
    assert ranks[0].poll(2000) and ranks[0].recv() == b"plan 0"


def test_a_stale_wake_up_does_not_cut_a_wait_short(channel):
    """A plan read before its byte was drained leaves the byte: the next wait must still
    last its time (a rank polls for its next plan during a forward, and preparing that
    plan early is the point of overlap scheduling)."""
    sched, ranks, _, send = channel
    sched.post(b"plan 0", send)
    assert ranks[0].recv() == b"plan 0"  # straight from the slot: its byte not read
    t0 = time.monotonic()
    assert not ranks[0].poll(50)
    assert time.monotonic() - t0 >= 0.045


def test_a_result_over_the_socket_still_frees_its_slot_once_taken(channel):
    """The executor collects a result that came over the socket before it has taken its
    slot's mark; it takes the marks before posting the next plan (ZmqExecutor.submit), or
    the post would find that slot's plan unanswered."""
    sched, ranks, router, send = channel
    sched.post(b"plan 0", send)
    sched.post(b"plan 1", send)
    huge = b"r" * step_channel.RESULT_SLOT_BYTES
    for rank in ranks:
        assert rank.recv() == b"plan 0"
        rank.send(huge)  # the mark in its slot, then the frame on the socket
    frames = [router.recv_multipart()[1] for _ in ranks if router.poll(2000)]
    assert frames == [huge, huge]
    with pytest.raises(AssertionError):
        sched.post(b"plan 2", send)  # marks not taken yet
    assert sched.take_results() == []  # the marks: nothing to hand out, slots freed
    sched.post(b"plan 2", send)


def test_only_ranks_on_this_host_and_x86_64(monkeypatch):
    assert "ipc://" in supported("tcp://10.0.0.1:5555")
    assert "absolute" in supported("ipc://workers.sock")
    monkeypatch.setattr(step_channel.platform, "machine", lambda: "aarch64")
    assert "x86-64" in supported("ipc:///tmp/x/workers.sock")
