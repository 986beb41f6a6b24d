"""The waiting queue's admission policy (fair across sessions, priority, preempted
first) and its bounds, alone and through the scheduler."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.queue import QueueFullError, RequestQueue
from scheduler.request import Sequence
from tests.scheduler.test_scheduler_unit import make, req, run_step
from wire.client import GenerateRequest

_ids = iter(range(1, 10**9))


def seq(rid: str, session: str | None = None, n: int = 10, priority: int = 0) -> Sequence:
    request = GenerateRequest(rid, list(range(n)), 4, session_id=session, priority=priority)
    return Sequence(next(_ids), request, frozenset(), b"")


def drain(q: RequestQueue) -> list[str]:
    out = []
    while len(q):
        assert q.peek() is not None
        out.append(q.pop().request_id)
    assert q.peek() is None and q.num_tokens == 0
    return out


def test_a_burst_from_one_session_does_not_starve_the_others():
    q = RequestQueue(100)
    for i in range(5):
        q.push(seq(f"a{i}", "A"))
    q.push(seq("b0", "B"))
    q.push(seq("b1", "B"))
    q.push(seq("solo"))  # no session: a lane of its own
    assert drain(q) == ["a0", "b0", "solo", "a1", "b1", "a2", "a3", "a4"]


def test_priority_first_then_fairness_and_preempted_before_all():
    q = RequestQueue(100)
    q.push(seq("a0", "A"))
    q.push(seq("a1", "A", priority=-1))  # behind a0 in its own lane: FIFO inside a session
    q.push(seq("urgent", "U", priority=-5))
    q.push(seq("late", "L", priority=3))
    q.push_front(seq("preempted", "A"))
    assert drain(q) == ["preempted", "urgent", "a0", "a1", "late"]


def test_bounds_by_requests_and_by_tokens():
    q = RequestQueue(3, max_tokens=100)
    q.push(seq("big", n=150))  # larger than the bound alone: queued, not refused forever
    with pytest.raises(QueueFullError, match="prompt tokens waiting"):
        q.push(seq("more", n=1))
    q.pop()
    q.push(seq("x", n=60))
    with pytest.raises(QueueFullError, match="150|100"):
        q.push(seq("y", n=50))
    q.push(seq("y", n=40))
    q.push_front(seq("preempted", n=500))  # admitted already: never refused, not counted
    assert q.num_tokens == 100 and len(q) == 3
    q2 = RequestQueue(2)
    q2.push(seq("a"))
    q2.push(seq("b"))
    with pytest.raises(QueueFullError, match="2 waiting"):
        q2.push(seq("c"))


def test_remove_from_any_place():
    q = RequestQueue(10)
    for rid, session in (("a0", "A"), ("a1", "A"), ("b0", "B")):
        q.push(seq(rid, session))
    q.push_front(seq("p"))
    assert q.remove("a0").request_id == "a0" and q.remove("p").request_id == "p"
    assert q.remove("nope") is None and "a1" in q and "a0" not in q
    assert [s.request_id for s in q] == ["a1", "b0"]
    assert drain(q) == ["a1", "b0"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "push", "pop", "remove", "front"]),
                          st.integers(0, 3), st.integers(1, 40)), max_size=60))
def test_queue_bookkeeping_property(ops):
    """Whatever the order of operations: nothing is lost or duplicated, the token count
    is the sum of what waits, and each session's requests leave in arrival order."""
    q = RequestQueue(8, max_tokens=120)
    waiting: dict[str, Sequence] = {}
    order: dict[str, list[str]] = {}
    left: list[str] = []
    for i, (op, session, n) in enumerate(ops):
        if op == "push":
            s = seq(f"r{i}", f"s{session}", n)
            try:
                q.push(s)
            except QueueFullError:
                continue
            waiting[s.request_id] = s
            order.setdefault(s.session_id, []).append(s.request_id)
        elif op == "front":
            s = seq(f"p{i}", f"s{session}", n)
            q.push_front(s)
            waiting[s.request_id] = s
        elif op == "pop" and len(q):
            left.append(q.pop().request_id)
            waiting.pop(left[-1])
        elif op == "remove" and waiting:
            rid = sorted(waiting)[session % len(waiting)]
            assert q.remove(rid) is waiting.pop(rid)
            for ids in order.values():
                if rid in ids:
                    ids.remove(rid)
        assert len(q) == len(waiting)
        assert q.num_tokens == sum(len(s.prompt) for r, s in waiting.items()
                                   if not r.startswith("p"))
    left += drain(q)
    for ids in order.values():
        assert [r for r in left if r in ids] == ids


def test_scheduler_admits_fairly_and_bounds_queued_tokens():
    s = make(max_num_seqs=1, max_queued_tokens=200)
    for i in range(4):
        s.add_request(req(f"a{i}", n=20, session_id="A"))
    s.add_request(req("b0", n=20, session_id="B"))
    with pytest.raises(Exception, match="prompt tokens waiting") as err:
        s.add_request(req("c0", n=150, session_id="C"))
    assert err.value.error_type == "overloaded"
    first_token_order: list[str] = []
    while s.has_work():
        _, outs = run_step(s)
        first_token_order += [o.request_id for o in outs
                              if o.request_id not in first_token_order]
    assert first_token_order == ["a0", "b0", "a1", "a2", "a3"]


def test_deadline_ends_a_waiting_and_a_running_request_with_timeout():
    s = make(max_num_seqs=1)
    s.add_request(req("runs", n=20, max_tokens=400, timeout_s=0.05))
    s.add_request(req("waits", n=20, timeout_s=0.05))
    run_step(s)
    runs = s.sequence("runs")
    assert runs.status.value == "running"
    time.sleep(0.06)
    plan, outs = run_step(s)
    # Expired while the plan was built: the running one is closed by that same plan
    # (it last ran in the step before), its blocks kept in the cache.
    assert plan.close == [runs.seq_id] and not plan.batch()
    ended = {o.request_id: o for o in outs if o.finished}
    assert set(ended) == {"runs", "waits"}
    for o in ended.values():
        assert o.finish_reason == "error" and o.error_type == "timeout"
        assert "deadline" in o.error
    assert not s.has_work()
    s.check_accounting()
    assert s.cache.usage()["device"]["used"] == 0
