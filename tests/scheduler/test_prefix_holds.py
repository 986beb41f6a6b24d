"""Waiting requests hold their cached prefixes (`AdmissionControl.hold_waiting`, cache `hold`).

A coding agent's next turn that waits behind other sessions' prefills must find its
history still cached when its turn comes: the blocks the running sequences need come
from elsewhere (older sessions, free blocks), and only when nothing else is left does a
hold give way, the last in the queue first, before anything running is preempted.
"""

from __future__ import annotations

from cache.hashing import make_extra_key
from scheduler.scheduler import Scheduler
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.lifecycle import EngineLimits

BS = 16


def make(num_blocks: int, num_host_blocks: int = 0, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", BS)
    config = EngineConfig(model="/models/m", **cfg)
    return Scheduler(config, EngineLimits(vocab_size=10_000, max_model_len=4096,
                                          eos_token_ids=(3,), num_device_blocks=num_blocks,
                                          num_host_blocks=num_host_blocks))


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    outs = s.update(plan, [(c.seq_id, token) for c in plan.batch() if c.sample])
    return plan, outs


def drain(s: Scheduler, limit: int = 2000) -> dict[str, object]:
    done = {}
    for _ in range(limit):
        if not s.has_work():
            break
        _, outs = run_step(s)
        s.check_accounting()
        done.update({o.request_id: o for o in outs if o.finished})
    assert not s.has_work()
    return done


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def first_turns(s: Scheduler) -> tuple[list[int], list[int]]:
    """Session A's first turn, then session B's (so A's blocks are the older ones in the
    LRU): 64 prompt tokens each, 4 answer tokens; both end cached (4 blocks each)."""
    a, b = tokens(1000, 64), tokens(2000, 64)
    for rid, prompt in (("a1", a), ("b1", b)):
        s.add_request(GenerateRequest(rid, prompt, 4, ignore_eos=True))
        drain(s)
    return a + [7] * 4, b + [7] * 4


def test_a_waiting_turn_keeps_its_history_while_another_prefill_grows():
    """X runs and grows by 3 blocks while A's next turn waits (one sequence at a time);
    the LRU's oldest blocks are A's, so unheld they are what X evicts. Held, B's go."""
    s = make(num_blocks=14, max_num_seqs=1)
    a, _ = first_turns(s)
    s.add_request(GenerateRequest("x", tokens(5000, 80), 40, ignore_eos=True))
    s.add_request(GenerateRequest("a2", a + tokens(3000, 20), 4, ignore_eos=True))
    run_step(s)  # x admitted (5 blocks); a2 waits, its 4-block prefix held
    assert s.queue.peek().request_id == "a2" and s.queue.peek().held
    assert s.cache.num_held_blocks == 4
    done = drain(s)
    assert done["a2"].num_device_cached_tokens == 64  # A's whole history, still cached
    # why the rest was computed, found when the prefix was held: the new turn's tokens
    u = done["a2"].uncached
    assert u.num_tokens == len(a) + 20 - 64 and u.evicted == 0 and u.main_reason == "new"
    assert s.cache.num_held_blocks == 0 and s.cache.usage()["device"]["used"] == 0
    stats = s.cache.stats  # the hold is counted once, at admission
    assert stats.num_queried_tokens == 64 + 64 + 80 + len(a) + 20
    assert stats.num_device_hit_tokens == 64


def test_a_hold_gives_way_before_a_running_sequence_is_preempted():
    """X needs every block: the waiting turn's hold is let go (its prefix is then
    evicted), and X runs to its end without a preemption."""
    s = make(num_blocks=10, max_num_seqs=1)
    a, _ = first_turns(s)
    s.add_request(GenerateRequest("x", tokens(5000, 80), 80, ignore_eos=True))  # 10 blocks
    s.add_request(GenerateRequest("a2", a + tokens(3000, 20), 4, ignore_eos=True))
    run_step(s)
    assert s.queue.peek().held
    given_way = False
    while s.sequence("x") is not None:
        assert s.sequence("x").num_preemptions == 0
        run_step(s)
        s.check_accounting()
        given_way |= s.sequence("x") is not None and not s.queue.peek().held
    assert given_way
    done = drain(s)
    assert done["a2"].num_device_cached_tokens < 64  # its history made room for x
    u = done["a2"].uncached  # found at its admission, after the hold gave way
    assert u.evicted == 64 - done["a2"].num_device_cached_tokens
    assert u.num_tokens == len(a) + 20 - done["a2"].num_device_cached_tokens
    assert s.cache.stats.num_queried_tokens == 64 + 64 + 80 + len(a) + 20  # x: once
    assert s.cache.usage()["device"]["used"] == 0


def test_an_aborted_waiting_request_lets_its_hold_go():
    s = make(num_blocks=14, max_num_seqs=1)
    a, _ = first_turns(s)
    s.add_request(GenerateRequest("x", tokens(5000, 40), 8, ignore_eos=True))
    s.add_request(GenerateRequest("a2", a + tokens(3000, 20), 4, ignore_eos=True))
    run_step(s)
    assert s.queue.peek().held
    out = s.abort_request("a2")
    assert out.finished and out.finish_reason == "abort"
    assert s.cache.num_held_blocks == 0
    s.check_accounting()  # no sequence holds blocks it should not
    drain(s)
    assert s.cache.usage()["device"]["used"] == 0


def test_host_hits_are_copied_in_while_the_request_waits():
    """A waiting turn whose history was pushed to the host tier gets its swap_ins in a
    plan before the one that admits it: the admitting step pays no copy."""
    s = make(num_blocks=16, num_host_blocks=32, max_num_seqs=1, max_num_batched_tokens=64)
    a = tokens(1000, 64)
    s.add_request(GenerateRequest("a1", a, 4, ignore_eos=True))
    drain(s)
    s.add_request(GenerateRequest("y", tokens(6000, 250), 4, ignore_eos=True))  # evicts A
    drain(s)
    assert s.cache.lookup(a + [7] * 4, make_extra_key("/models/m", None)).num_host_tokens == 64
    s.add_request(GenerateRequest("x", tokens(5000, 40), 20, ignore_eos=True))
    s.add_request(GenerateRequest("a2", a + [7] * 4 + tokens(3000, 20), 4,
                                  ignore_eos=True))
    plan, _ = run_step(s)
    a2 = s.queue.peek()
    assert a2.request_id == "a2" and a2.held and len(plan.swap_in) == 4
    while s.queue.peek() is not None:
        plan, _ = run_step(s)
    assert s.sequence("a2").opened and not plan.swap_in  # admitted: no copy left to do
    done = drain(s)
    assert done["a2"].num_host_cached_tokens == 64


def test_a_hold_is_let_go_for_a_longer_hit_found_meanwhile():
    """Two agents sent the same fresh context: the second, held with the first chunk's
    blocks (registered as the step that writes them is planned), takes the rest of the
    first one's blocks once they are written."""
    s = make(num_blocks=32, max_num_seqs=1, max_num_batched_tokens=64)
    shared = tokens(1000, 96)
    s.add_request(GenerateRequest("first", shared + [1], 4, ignore_eos=True))
    s.add_request(GenerateRequest("second", shared + [2], 4, ignore_eos=True))
    run_step(s)
    assert s.queue.peek().held and s.cache.num_held_blocks == 4  # the first 64 tokens
    done = drain(s)
    assert done["second"].num_device_cached_tokens == 96
