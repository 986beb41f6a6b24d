"""tools/benchmarks/trace_load.py: the trace's sessions, as a driver sees them (no engine)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from tools.benchmarks.trace_load import (
    SeenPrefix,
    TraceParams,
    TraceRequest,
    TraceSession,
    instant_timeline,
    make_trace,
    recomputed_seen,
)

SMALL = TraceParams(sessions=6, system_tokens=64, first_user_tokens=16, turn_tokens_median=24,
                    turns_median=4, summary_tokens=32, compaction_prompt_tokens=8,
                    subagent_system_tokens=40, title_system_tokens=8, max_tokens=4,
                    context_limit=1024, vocab=tuple(range(10, 500)), bos=1)


def answer_of(request: TraceRequest) -> list[int]:
    """A deterministic answer of the asked length (what an engine would send back)."""
    return [7 + (request.turn + i) % 3 for i in range(request.max_tokens)]


def run(session: TraceSession) -> tuple[list[TraceRequest], list[TraceSession]]:
    """Every request of one session, in order, and the sessions it spawned (not run)."""
    requests, children = [], []
    request = session.next_request(None)
    while request is not None:
        children += session.spawned()
        requests.append(request)
        request = session.next_request(answer_of(request))
    return requests, children


def run_all(params: TraceParams) -> dict[str, list[TraceRequest]]:
    """Every session's requests, spawned ones included."""
    out: dict[str, list[TraceRequest]] = {}
    todo = make_trace(params)
    while todo:
        session = todo.pop()
        out[session.session_id], children = run(session)
        todo += children
    return out


def test_the_same_params_make_the_same_trace_and_a_salt_changes_only_tokens():
    a, b = run_all(SMALL), run_all(SMALL)
    assert a == b
    assert [s.start_s for s in make_trace(SMALL)] == [s.start_s for s in make_trace(SMALL)]
    salted = run_all(replace(SMALL, salt="other"))
    assert salted.keys() == a.keys()
    for sid in a:  # the same lengths, pauses and kinds; other tokens
        shape = [(len(r.prompt), r.pause_before_s, r.kind, r.wait_for) for r in a[sid]]
        assert shape == [(len(r.prompt), r.pause_before_s, r.kind, r.wait_for)
                         for r in salted[sid]]
        assert a[sid][0].prompt[1:20] != salted[sid][0].prompt[1:20]
    reseeded = run_all(replace(SMALL, seed=1))
    assert reseeded != a


def test_each_prompt_extends_the_previous_prompt_and_its_answer():
    for sid, requests in run_all(SMALL).items():
        for prev, r in zip(requests, requests[1:]):
            if prev.kind == "compaction_summary":
                continue
            history = prev.prompt + answer_of(prev)
            assert r.prompt[:len(history)] == history, (sid, r.turn)
            assert len(r.prompt) > len(history)
        assert [r.turn for r in requests] == list(range(len(requests)))
        assert all(r.session_id == sid for r in requests)


def test_turns_add_tokens_that_no_other_session_or_turn_has():
    sessions = run_all(replace(SMALL, kinds=1, title_prob=0.0, subagent_prob=0.0))
    system_len = 1 + SMALL.system_tokens
    firsts = [requests[0].prompt for requests in sessions.values()]
    assert all(f[:system_len] == firsts[0][:system_len] for f in firsts)  # shared
    own: list[tuple[int, ...]] = []
    for requests in sessions.values():
        history: list[int] = requests[0].prompt[:system_len]
        for r in requests:
            added = r.prompt[len(history):] if r.prompt[:len(history)] == history else []
            own += [tuple(added[i:i + 8]) for i in range(0, len(added) - 7, 8)]
            history = r.prompt + answer_of(r)
    assert len(own) > 50 and len(set(own)) == len(own)


def test_compaction_fires_near_the_limit_and_the_session_goes_on_from_a_summary():
    params = replace(SMALL, turns_median=40, turns_sigma=0.0, subagent_prob=0.0)
    compactions = 0
    for requests in run_all(params).values():
        system = requests[0].prompt[:1 + params.system_tokens]
        for i, r in enumerate(requests):
            if r.kind != "compaction_summary":
                assert len(r.prompt) + r.max_tokens <= params.compaction_limit, r
                continue
            assert len(r.prompt) + r.max_tokens <= params.context_limit
            compactions += 1
            prev, after = requests[i - 1], requests[i + 1]
            history = prev.prompt + answer_of(prev)
            assert r.prompt[:len(history)] == history
            assert len(r.prompt) == len(history) + params.compaction_prompt_tokens
            # it came because the next turn would have passed the limit
            new_turn = len(after.prompt) - len(system) - params.summary_tokens
            assert len(history) + new_turn + params.max_tokens > params.compaction_limit
            # the history is replaced: the system prompt, a summary, that turn; no pause
            assert after.prompt[:len(system)] == system and after.kind == "turn"
            assert len(after.prompt) < len(prev.prompt) / 2 and after.pause_before_s == 0
            assert after.prompt[len(system):len(system) + 8] != \
                history[len(system):len(system) + 8]
    assert compactions >= 6


def test_subagents_use_their_own_system_prompt_and_their_parent_waits_for_them():
    params = replace(SMALL, sessions=12, subagent_prob=1.0, subagents_max=2, kinds=2,
                     turns_sigma=0.0)
    sub_systems: dict[int, set[tuple[int, ...]]] = {0: set(), 1: set()}
    num_subs = 0
    for s in make_trace(params):
        requests, children = run(s)
        subs = [c for c in children if c.role == "subagent"]
        assert subs  # every session launches some (subagent_prob=1)
        launched = [r for r in requests if r.wait_for]
        assert len(launched) == 1
        assert set(launched[0].wait_for) == {c.session_id for c in subs}
        assert launched[0].pause_before_s == 0  # the tool call returns their reports
        for c in subs:
            sub_requests, grandchildren = run(c)
            assert not grandchildren and all(r.kind == "subagent" for r in sub_requests)
            assert params.subagent_turns_min <= len(sub_requests) <= params.subagent_turns_max
            sub_system = sub_requests[0].prompt[:1 + params.subagent_system_tokens]
            assert sub_system[1:9] != requests[0].prompt[1:9]
            sub_systems[s.kind].add(tuple(sub_system))
            num_subs += 1
    assert num_subs >= 12
    # one system prompt for the sub-agents of a kind, another for the other kind's
    assert len(sub_systems[0]) == len(sub_systems[1]) == 1
    assert sub_systems[0] != sub_systems[1]


def test_a_title_request_is_a_one_off_with_a_tiny_system_prompt_of_its_own():
    params = replace(SMALL, title_prob=1.0)
    titles = 0
    for s in make_trace(params):
        first = s.next_request(None)
        (title,) = s.spawned()
        assert s.spawned() == []  # handed out once
        requests, _ = run(title)
        assert [r.kind for r in requests] == ["title"] and title.start_s == 0
        assert requests[0].max_tokens == params.title_max_tokens
        assert len(requests[0].prompt) == 1 + params.title_system_tokens + \
            params.first_user_tokens
        assert requests[0].prompt[2:9] != first.prompt[2:9]
        assert requests[0].prompt[-params.first_user_tokens:] == \
            first.prompt[-params.first_user_tokens:]  # the user's first message
        titles += 1
    assert titles == params.sessions


def test_pauses_are_log_normal_with_the_stated_median_and_p99_times_the_scale():
    params = replace(TraceParams(), sessions=3000, subagent_prob=0.0, time_scale=0.5)
    pauses = np.array([p for s in make_trace(params) for p in s.plan.pauses_s[1:]])
    assert len(pauses) > 20_000
    assert np.median(pauses) == pytest.approx(5.2 * 0.5, rel=0.03)
    assert np.percentile(pauses, 99) == pytest.approx(81 * 0.5, rel=0.08)
    starts = [s.start_s for s in make_trace(replace(params, sessions=400))]
    gaps = np.diff(starts)
    assert np.all(gaps >= 0) and np.mean(gaps) == pytest.approx(params.stagger_s * 0.5, rel=0.12)
    turns = [s.plan.turns for s in make_trace(params)]
    assert np.median(turns) == pytest.approx(params.turns_median, abs=1)
    twice = make_trace(replace(params, sessions=5, time_scale=1.0))
    once = make_trace(replace(params, sessions=5))
    assert [2 * s.start_s for s in once] == pytest.approx([s.start_s for s in twice])
    assert [2 * p for p in once[1].plan.pauses_s] == pytest.approx(twice[1].plan.pauses_s)


def test_seen_prefix_counts_whole_blocks_sent_and_answered_before():
    seen = SeenPrefix(block_size=16)
    prompt = list(range(40))
    assert seen.seen_tokens(prompt) == 0
    seen.add(prompt, answer=[100, 101, 102, 103, 104, 105, 106, 107])
    # 40 + 7 computed tokens (the last answer token never is): 2 whole blocks
    follow_up = prompt + [100, 101, 102, 103, 104, 105, 106, 107] + list(range(200, 220))
    assert seen.seen_tokens(follow_up) == 32
    assert seen.seen_tokens(prompt[:32]) == 16  # a hit stops before the last prompt token
    assert seen.seen_tokens(prompt[:33]) == 32
    changed = prompt[:20] + [999] + prompt[21:]
    assert seen.seen_tokens(changed) == 16  # the chain stops at the first block that differs
    assert seen.seen_tokens([5, *prompt]) == 0  # the same tokens elsewhere are not a prefix
    seen.add(follow_up, answer=[1])
    assert seen.seen_tokens(follow_up + [3]) == 64
    assert recomputed_seen(64, 48) == 16 and recomputed_seen(32, 48) == 0


def test_the_instant_driver_sends_every_request_and_waits_where_told():
    params = replace(SMALL, sessions=8, subagent_prob=1.0, title_prob=1.0)
    timeline = instant_timeline(params)
    expected = {sid: len(rs) for sid, rs in run_all(params).items()}
    sent: dict[str, int] = {}
    for t, r in timeline.sent:
        sent[r.session_id] = sent.get(r.session_id, 0) + 1
        for child in r.wait_for:
            assert t >= timeline.ends[child]
    assert sent == expected and set(timeline.ends) == set(expected)
    times = [t for t, _ in timeline.sent]
    assert times == sorted(times)
    live = timeline.live_context(step_s=0.25)
    longest = max(len(r.prompt) + r.max_tokens for _, r in timeline.sent)
    assert live.max() >= longest and live.min() >= 0


@pytest.mark.parametrize("bad", [
    {"sessions": 0}, {"pause_p99_s": 1.0}, {"time_scale": 0.0}, {"vocab": ()},
    {"subagent_turns_max": 1}, {"context_limit": 2000}, {"compaction_at": 1.5},
])
def test_params_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        replace(TraceParams(), **bad)


def test_the_pause_sigma_puts_p99_where_stated():
    p = TraceParams(pause_median_s=2.0, pause_p99_s=50.0)
    assert math.exp(math.log(2.0) + 2.3263478740408408 * p.pause_sigma) == pytest.approx(50.0)
