"""Session-aware retention (scheduler `_finish`, `end_turn`; cache/retention.py), on a fake
clock: a finished agent turn stays retained for --session-ttl, evicted only after plain
blocks; a turn that ends without a tool call lets its blocks go; the next turn releases
and renews them; the TTL ends it."""

from __future__ import annotations

from cache.hashing import make_extra_key
from scheduler.scheduler import Scheduler
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.lifecycle import EngineLimits

BS = 16
TTL = 90.0
KEY = make_extra_key("/models/m", None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, num_blocks: int = 12, **cfg) -> Scheduler:
    cfg.setdefault("max_retained_fraction", 1.0)
    cfg.setdefault("session_ttl_s", TTL)
    config = EngineConfig(model="/models/m", max_num_batched_tokens=512, **cfg)
    return Scheduler(config, EngineLimits(vocab_size=10_000, max_model_len=4096,
                                          eos_token_ids=(3,), num_device_blocks=num_blocks,
                                          num_host_blocks=0), clock=clock)


def run(s: Scheduler, rid: str, prompt: list[int], *, tool_call: bool | None = None,
        end_before_close: bool = False) -> list[int]:
    """One request to its close (4 answer tokens); `tool_call` sends the shim's TurnEnd
    (after the close, or between the final token and the close). Returns prompt + answer."""
    s.add_request(GenerateRequest(rid, prompt, 4, ignore_eos=True, session_id=rid[0]))
    while s.has_work():
        plan = s.schedule()
        outs = s.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
        if tool_call is not None and end_before_close and any(o.finished for o in outs):
            s.end_turn(rid, tool_call)
            tool_call = None
        s.check_accounting()
    if tool_call is not None:
        s.end_turn(rid, tool_call)
    return prompt + [7] * 4


def cached(s: Scheduler, tokens: list[int]) -> int:
    return s.cache.lookup(tokens, KEY).num_tokens


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def pressure(s: Scheduler, num_blocks: int, start: int = 9000) -> None:
    """A one-off that needs `num_blocks` more than the free list has, then ends plain
    (an answer without a tool call)."""
    need = num_blocks + s.cache.device.num_free
    run(s, "zz", tokens(start, need * BS - 4), tool_call=False)


def test_a_turn_is_retained_and_a_turn_that_ended_goes_first():
    """S (older) ended in a tool call, O (newer) without one: the plain LRU would evict S
    first; retained, S stays and O goes."""
    for ttl, s_kept in ((TTL, True), (0.0, False)):
        s = make(Clock(), session_ttl_s=ttl)
        s_turn = run(s, "s1", tokens(1000, 64), tool_call=True)
        o_turn = run(s, "o1", tokens(2000, 64), tool_call=False)
        pressure(s, 3)
        assert (cached(s, s_turn) == 64) is s_kept, ttl
        assert cached(s, o_turn) < 64 if ttl else cached(s, o_turn) == 64


def test_the_turn_end_is_applied_before_or_after_the_close():
    for before in (True, False):
        s = make(Clock())
        s_turn = run(s, "s1", tokens(1000, 64), tool_call=False, end_before_close=before)
        o_turn = run(s, "o1", tokens(2000, 64), tool_call=True)
        pressure(s, 3)
        assert cached(s, s_turn) < 64 and cached(s, o_turn) == 64, before
        assert s.cache.device.lru.num_retained <= 4 + 5  # o's, and the pressure's head


def test_the_next_turn_releases_and_renews_the_retention():
    clock = Clock()
    s = make(clock)
    turn1 = run(s, "s1", tokens(1000, 64), tool_call=True)
    assert s.cache.usage()["device"]["retained"] == 4
    clock.now += 60  # a tool runs
    s.add_request(GenerateRequest("s2", turn1 + tokens(3000, 30), 4, ignore_eos=True,
                                  session_id="s"))
    s.update(plan := s.schedule(), [(c.seq_id, 7) for c in plan.batch() if c.sample])
    assert s.sequence("s2").num_device_cached == 64
    assert s.cache.usage()["device"]["retained"] == 0  # in use: released
    while s.has_work():
        plan = s.schedule()
        s.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
    s.end_turn("s2", tool_call=True)
    assert s.cache.usage()["device"]["retained"] == 6  # 98 + 4 tokens: 6 full blocks
    clock.now += TTL - 1  # renewed by the second turn: still retained past the first TTL
    assert s.cache.device.lru.expire() == 0
    clock.now += 2
    assert s.cache.device.lru.expire() == 6


def test_retention_ends_with_the_ttl():
    clock = Clock()
    s = make(clock)
    s_turn = run(s, "s1", tokens(1000, 64), tool_call=True)
    clock.now += TTL + 1  # the user went away
    o_turn = run(s, "o1", tokens(2000, 64), tool_call=True)
    pressure(s, 3)
    assert cached(s, s_turn) < 64 and cached(s, o_turn) == 64


def test_a_paused_sessions_tail_goes_before_the_shared_system_prompt():
    """A and B share a 32-token system prompt; A's turn is older. Under pressure A's own
    blocks go, tail first, and the shared head (B used it last) stays."""
    s = make(Clock())
    system = tokens(100, 32)
    a_turn = run(s, "a1", system + tokens(1000, 32), tool_call=True)
    b_turn = run(s, "b1", system + tokens(2000, 32), tool_call=True)
    pressure(s, 2)
    assert cached(s, a_turn) == 32  # the system prompt: A's next turn reads only its own
    assert cached(s, b_turn) == 64


def test_a_finished_sub_agent_goes_before_its_parent():
    """The parent waits on a tool call (its sub-agent) and is older; the sub-agent's last
    answer is not a tool call: its blocks go first."""
    s = make(Clock())
    parent = run(s, "p1", tokens(1000, 64), tool_call=True)
    sub = run(s, "q1", tokens(5000, 32), tool_call=True)
    sub = run(s, "q2", sub + tokens(6000, 24), tool_call=False)  # done: returns its result
    pressure(s, 3)
    assert cached(s, parent) == 64
    assert cached(s, sub) < 48


def test_a_client_s_own_marks_govern_its_blocks():
    """cache_control marks (here a 5-minute TTL on the first 32 tokens) stay as the client
    gave them: no session retention of the rest, and a TurnEnd does not release them."""
    from wire.client import Retention

    clock = Clock()
    s = make(clock)
    prompt = tokens(1000, 64)
    s.add_request(GenerateRequest("m1", prompt, 4, ignore_eos=True, session_id="m",
                                  retention=[Retention(32, 300.0)]))
    while s.has_work():
        plan = s.schedule()
        s.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
    s.end_turn("m1", tool_call=False)
    assert s.cache.usage()["device"]["retained"] == 2
