"""Why a prompt missed, through the real scheduler and its cache (no ranks): the reasons of
each case, the outputs that carry them, the request_done line and the counters, and a
property: whatever the traffic, the reasons add up to the prompt tokens not served."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from scheduler.scheduler import Scheduler
from scheduler.telemetry import Telemetry
from wire.client import UNCACHED_REASONS, GenerateRequest, RequestOutput, UncachedTokens
from wire.config import EngineConfig
from wire.lifecycle import EngineLimits

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 64, num_host_blocks: int = 0, clock: Clock | None = None,
         **cfg) -> Scheduler:
    # plain LRU (no session retention): which blocks other sessions evict is then known
    cfg.setdefault("session_ttl_s", 0.0)
    config = EngineConfig(model="/models/m", **cfg)
    return Scheduler(config, EngineLimits(vocab_size=1000, max_model_len=512,
                                          eos_token_ids=(3,), num_device_blocks=num_blocks,
                                          num_host_blocks=num_host_blocks), clock or Clock())


def serve(s: Scheduler, rid: str, tokens: list[int], session: str | None = None,
          salt: str | None = None, telemetry: Telemetry | None = None,
          max_tokens: int = 2) -> list[RequestOutput]:
    """Run one request to its end (and its close); its outputs."""
    s.add_request(GenerateRequest(rid, tokens, max_tokens, session_id=session, cache_salt=salt,
                                  ignore_eos=True))
    if telemetry is not None:
        telemetry.request_added(s.sequence(rid))
    outs: list[RequestOutput] = []
    for _ in range(100):
        plan = s.schedule()
        for out in s.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample]):
            if out.request_id != rid:
                continue
            outs.append(out)
            if out.finished:
                if telemetry is not None:
                    telemetry.request_done(out)
                s.schedule()  # its close
                return outs
    raise AssertionError(f"{rid} did not finish")


def reasons(outs: list[RequestOutput]) -> UncachedTokens:
    """The reasons the outputs carried: on the first and on the last, the same; they add
    up to the prompt tokens not served."""
    first, last = outs[0], outs[-1]
    assert first.uncached is not None and first.uncached == last.uncached
    assert all(o.uncached is None for o in outs[1:-1])
    cached = (last.num_device_cached_tokens + last.num_host_cached_tokens
              + last.num_disk_cached_tokens)
    assert last.uncached.num_tokens == last.num_prompt_tokens - cached
    return last.uncached


SYSTEM = list(range(10, 42))  # two blocks every prompt of the session starts with
HISTORY = SYSTEM + list(range(100, 300))  # 232 tokens


def test_new_then_only_the_block_remainder() -> None:
    s = make()
    u = reasons(serve(s, "a", HISTORY, session="s"))
    assert (u.new, u.block_remainder, u.main_reason) == (224, 8, "new")
    u = reasons(serve(s, "b", HISTORY + [7, 7, 500, 501], session="s"))
    # every full block of the previous prompt and output hit: what is left is the last
    # partial block (the previous output's tail and the new turn)
    assert u == UncachedTokens(block_remainder=12)


def test_evicted_blocks_name_the_tier_their_age_and_cause() -> None:
    clock = Clock()
    s = make(num_blocks=20, clock=clock)
    serve(s, "a", HISTORY, session="s")
    clock.t += 60
    for i in range(2):  # other sessions fill the device tier: HISTORY's blocks are reused
        serve(s, f"other{i}", list(range(300 + 150 * i, 450 + 150 * i)), session=f"o{i}")
    clock.t += 15
    u = reasons(serve(s, "b", HISTORY + [7, 7, 600], session="s"))
    # 14 cacheable blocks: the LRU took all but the head (a chain's tail goes first)
    assert (u.evicted, u.block_remainder, u.main_reason) == (208, 11, "evicted")
    assert (u.evicted_tier, u.evicted_by) == ("device", "admission")
    assert 15 <= u.evicted_age_s <= 75


def test_evicted_from_the_host_tier() -> None:
    clock = Clock()
    s = make(num_blocks=20, num_host_blocks=16, clock=clock, kv_write_policy="write_back")
    serve(s, "a", HISTORY, session="s")
    for i in range(4):  # the device tier writes back into a host tier too small to keep it
        serve(s, f"other{i}", list(range(300 + 150 * i, 450 + 150 * i)), session=f"o{i}")
    u = reasons(serve(s, "b", HISTORY, session="s"))
    assert u.evicted == 224 and (u.evicted_tier, u.evicted_by) == ("host", "write_back")


def test_an_edited_message_diverges_at_its_token() -> None:
    s = make()
    serve(s, "a", HISTORY, session="s")
    edited = list(HISTORY)
    edited[100] = 999  # an edited middle message
    u = reasons(serve(s, "b", edited + [7, 7, 600], session="s"))
    # 235 tokens, 14 cacheable blocks: blocks 0-5 hit (96 tokens); from block 6 (the edit
    # at 100) on, the previous sequence (234 tokens) had other tokens: edited
    assert (u.diverged, u.diverged_at, u.new, u.block_remainder) == (128, 100, 0, 11)
    assert u.main_reason == "diverged"


def test_another_cache_salt() -> None:
    s = make()
    serve(s, "a", HISTORY, session="s", salt="blue")
    u = reasons(serve(s, "b", HISTORY + [7, 7], session="s", salt="green"))
    assert (u.salt, u.block_remainder, u.main_reason) == (224, 10, "salt")


def test_a_summary_that_keeps_only_the_system_prompt_is_a_compaction() -> None:
    s = make()
    serve(s, "a", HISTORY + list(range(400, 600)), session="s")  # 432 tokens
    summary = SYSTEM + list(range(700, 800))  # 132 tokens
    u = reasons(serve(s, "b", summary, session="s"))
    assert (u.compaction, u.diverged_at, u.block_remainder) == (96, 32, 4)
    assert u.main_reason == "compaction"


def test_a_preempted_sequence_is_attributed_once() -> None:
    s = make(num_blocks=12)
    s.add_request(GenerateRequest("a", list(range(10, 90)), 60, ignore_eos=True))
    s.add_request(GenerateRequest("b", list(range(200, 280)), 60, ignore_eos=True))
    preempted = False
    for _ in range(200):
        plan = s.schedule()
        s.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
        preempted = preempted or any(q.num_preemptions for q in s.waiting())
        if not s.has_work():
            break
    assert preempted
    st_ = s.cache.stats
    assert st_.num_queried_tokens == 160  # each prompt once
    assert sum(getattr(st_, f"num_uncached_{r}_tokens") for r in UNCACHED_REASONS) == 160


def test_the_request_done_line_says_why() -> None:
    clock = Clock()
    s = make(num_blocks=20, clock=clock)
    telemetry = Telemetry()
    serve(s, "a", HISTORY, session="s", telemetry=telemetry)
    edited = list(HISTORY)
    edited[100] = 999
    with capture_logs() as logs:
        serve(s, "b", edited, session="s", telemetry=telemetry)
    (done,) = [e for e in logs if e["event"] == "request_done"]
    assert done["miss_reason"] == "diverged" and done["diverged_at"] == 100
    assert done["uncached_tokens"] == done["uncached_diverged"] + done["uncached_block_remainder"]
    assert "uncached_new" not in done and "evicted_tier" not in done
    for i in range(2):
        serve(s, f"other{i}", list(range(300 + 150 * i, 450 + 150 * i)), telemetry=telemetry)
    clock.t += 30
    with capture_logs() as logs:
        serve(s, "c", HISTORY, session="s", telemetry=telemetry)
    (done,) = [e for e in logs if e["event"] == "request_done"]
    assert done["miss_reason"] == "evicted" and done["evicted_tier"] == "device"
    assert done["evicted_age_s"] >= 30 and done["evicted_by"] == "admission"
    assert telemetry.recent[-1].uncached.evicted == done["uncached_evicted"]


# --- the property ---------------------------------------------------------------------

EDITS = st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 60)),  # the previous sequence and a turn
    st.tuples(st.just("edit"), st.integers(0, 200)),  # a token of it changed
    st.tuples(st.just("compact"), st.integers(0, 40)),  # a prefix of it and a summary
    st.tuples(st.just("again"), st.just(0)),  # the same again (a retry)
    st.tuples(st.just("fresh"), st.integers(1, 200)),  # another conversation
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(14, 30), num_host_blocks=st.sampled_from([0, 0, 8, 30]),
       policy=st.sampled_from(["write_back", "write_through"]),
       budget=st.sampled_from([2048, 48]),
       traffic=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, "x"]), EDITS,
                                  st.integers(1, 3)), min_size=1, max_size=20))
def test_the_reasons_always_add_up_to_the_tokens_not_served(num_blocks, num_host_blocks,
                                                            policy, budget, traffic) -> None:
    s = make(num_blocks=num_blocks, num_host_blocks=num_host_blocks, kv_write_policy=policy,
             max_num_batched_tokens=budget)
    last: dict[int, list[int]] = {}  # session -> its latest prompt and output
    fresh = iter(range(0, 1_000_000, 1000))
    longest = (num_blocks - 1) * BS  # a prompt the device tier can hold
    for i, (session, salt, (edit, n), max_tokens) in enumerate(traffic):
        base = last.get(session, [])
        if edit == "extend" or not base:
            start = next(fresh)
            tokens = base + list(range(start, start + n + 1))
        elif edit == "edit":
            tokens = list(base)
            tokens[n % len(tokens)] = 999
        elif edit == "compact":
            tokens = base[:n] + list(range(500, 520))
        elif edit == "again":
            tokens = list(base)
        else:
            start = next(fresh) % 997
            tokens = list(range(start, start + n))
        tokens = [t % 997 for t in tokens][:longest]
        outs = serve(s, f"r{i}", tokens, session=f"s{session}", salt=salt,
                     max_tokens=max_tokens)
        for reason, n in reasons(outs).by_reason().items():  # they add up
            if n and reason != "block_remainder":
                event(reason)
        last[session] = tokens + [7] * len(outs[-1].token_ids)
        s.cache.check_invariants()
    st_ = s.cache.stats
    hits = st_.num_device_hit_tokens + st_.num_host_hit_tokens + st_.num_disk_hit_tokens
    assert sum(getattr(st_, f"num_uncached_{r}_tokens")
               for r in UNCACHED_REASONS) == st_.num_queried_tokens - hits
