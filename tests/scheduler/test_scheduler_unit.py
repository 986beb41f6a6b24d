"""The scheduler alone (no model, no ranks): admission, limits, batching, close, preemption."""

from __future__ import annotations

import pytest

from scheduler.control import SchedulerControl
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.telemetry import Telemetry, summarize
from wire.client import GenerateRequest, RequestOutput
from wire.config import EngineConfig
from wire.control_server import control_address
from wire.lifecycle import EngineLimits


def make(num_blocks: int = 64, **cfg) -> Scheduler:
    config = EngineConfig(model="/models/m", **cfg)
    return Scheduler(config, EngineLimits(vocab_size=1000, max_model_len=512,
                                          eos_token_ids=(3,), num_device_blocks=num_blocks,
                                          num_host_blocks=0))


def req(rid: str, n: int = 20, max_tokens: int = 4, **kw) -> GenerateRequest:
    return GenerateRequest(rid, list(range(10, 10 + n)), max_tokens, **kw)


def run_step(s: Scheduler, token: int = 7):
    """Plan one step and feed back `token` for every sampled chunk."""
    plan = s.schedule()
    outs = s.update(plan, [(c.seq_id, token) for c in plan.batch() if c.sample])
    return plan, outs


@pytest.mark.parametrize("bad,message", [
    (GenerateRequest("a", [], 4), "empty"),
    (GenerateRequest("a", [1, 1000], 4), "outside the vocabulary"),
    (GenerateRequest("a", [1] * 512, 4), "prompt is too long: 512 tokens > 511 maximum"),
    (GenerateRequest("a", [1, 2], 0), "max_tokens"),
])
def test_bad_requests_are_rejected_with_a_message(bad, message):
    with pytest.raises(RequestRejected, match=message) as err:
        make().add_request(bad)
    assert err.value.error_type == "invalid_request"


def test_full_queue_rejects_as_overloaded():
    s = make(max_queued_requests=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(RequestRejected, match="queue is full") as err:
        s.add_request(req("c"))
    assert err.value.error_type == "overloaded"


def test_prompt_larger_than_the_device_tier_is_refused():
    # worded as the context-length error, which agents answer by compacting
    with pytest.raises(RequestRejected, match="prompt is too long: 100 tokens > 64 maximum"):
        make(num_blocks=4).add_request(req("big", n=100))


def test_token_budget_and_sequence_cap():
    s = make(max_num_batched_tokens=32, max_num_seqs=2)
    for i in range(3):  # different prompts: no prefix to share
        s.add_request(GenerateRequest(f"r{i}", list(range(100 * i + 10, 100 * i + 30)), 4))
    plan, _ = run_step(s)
    assert sum(len(c.token_ids) for c in plan.batch()) <= 32
    assert len({c.seq_id for c in plan.batch()}) <= 2
    assert [len(c.token_ids) for c in plan.batch()] == [20, 12]  # second prompt chunked
    assert not plan.batch()[1].sample
    assert len(s.queue) == 1


def prompts(n: int, length: int) -> list[GenerateRequest]:
    """n prompts with no prefix in common (nothing for the cache to share)."""
    return [GenerateRequest(f"r{i}", list(range(100 * i + 10, 100 * i + 10 + length)), 4,
                            ignore_eos=True) for i in range(n)]


def test_prompts_arriving_together_start_one_after_another_past_the_pack_limit():
    s = make(max_num_batched_tokens=256, prefill_pack_tokens=64)
    for r in prompts(4, 40):
        s.add_request(r)
    first, _ = run_step(s)  # 40 < 64: a second prompt joins; 80 >= 64: no third
    assert [len(c.token_ids) for c in first.chunks] == [40, 40]
    second, _ = run_step(s)  # the first two decode beside the next two prompts
    assert len(second.decodes) == 2 and [len(c.token_ids) for c in second.chunks] == [40, 40]
    assert not s.queue


def test_a_running_prefill_counts_against_the_pack_limit():
    s = make(max_num_batched_tokens=64, prefill_pack_tokens=32)
    long, short = prompts(2, 100)[0], prompts(2, 10)[1]
    s.add_request(long)
    s.add_request(short)
    seen = []
    while s.queue:  # the long prompt's chunks fill each step: the short one waits
        plan, _ = run_step(s)
        seen.append([len(c.token_ids) for c in plan.chunks])
    # its last 36 tokens are past the limit too: the short prompt starts the step after
    assert seen == [[64], [36], [10]]


def test_the_queue_view_says_a_prompt_waits_behind_the_pack_limit(tmp_path):
    s, telemetry = make(max_num_batched_tokens=256, prefill_pack_tokens=64), Telemetry()
    for r in prompts(3, 40):
        s.add_request(r)
    telemetry.trace.append(summarize(s.schedule()))  # two prompts start: 80 >= 64
    control = SchedulerControl(s, telemetry, control_address(tmp_path, "scheduler"))
    try:
        waiting = control.snapshot().waiting
    finally:
        control.close()
    assert [(w.request_id, w.reason) for w in waiting] == [("r2", "prefill_pack")]


def test_pack_limit_zero_packs_up_to_the_budget():
    s = make(max_num_batched_tokens=256, prefill_pack_tokens=0)
    for r in prompts(4, 40):
        s.add_request(r)
    plan, _ = run_step(s)
    assert [len(c.token_ids) for c in plan.chunks] == [40] * 4
    # a running prefill's chunk leaves the rest of the budget to a waiting prompt
    s = make(max_num_batched_tokens=64, prefill_pack_tokens=0)
    long, short = prompts(2, 100)[0], prompts(2, 10)[1]
    s.add_request(long)
    run_step(s)  # its first 64 tokens
    s.add_request(short)
    plan, _ = run_step(s)
    assert [len(c.token_ids) for c in plan.chunks] == [36, 10]


def test_close_is_planned_one_step_after_the_final_token():
    s = make()
    s.add_request(req("a", max_tokens=2, ignore_eos=True))
    p0, _ = run_step(s)
    p1, outs = run_step(s)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    sid = p0.new_seqs[0].seq_id
    assert sid in {c.seq_id for c in p1.batch()} and sid not in p1.close
    p2, _ = run_step(s)
    assert p2.close == [sid] and not p2.batch()
    assert s.cache.usage()["device"]["used"] == 0
    assert s.cache.usage()["device"]["cached"] == 1  # its full block stays hittable
    assert not s.has_work()


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make()
    s.add_request(req("eos", max_tokens=10))
    s.add_request(req("stop", n=30, max_tokens=10, stop_token_ids=[9], ignore_eos=True))
    _, outs = run_step(s, token=3)  # EOS: ends "eos"; "stop" ignores EOS
    done = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert done == {"eos": "stop"}
    _, outs = run_step(s, token=9)
    assert [o.finish_reason for o in outs if o.finished] == ["stop"]


def test_abort_while_queued_and_while_running():
    s = make(max_num_seqs=1)
    s.add_request(req("run"))
    s.add_request(req("wait"))
    run_step(s)
    out = s.abort_request("wait")
    assert out.finished and out.finish_reason == "abort"
    out = s.abort_request("run")
    assert out.finished and out.finish_reason == "abort"
    plan, _ = run_step(s)
    assert len(plan.close) == 1 and not plan.batch()
    assert s.abort_request("run") is None  # already finished: nothing to do


def test_preemption_closes_and_requeues_the_newest():
    # 5 blocks of 16 tokens: both 30-token prompts fit (2 blocks each), their growth does not
    s = make(num_blocks=5, max_num_batched_tokens=64)
    s.add_request(req("old", n=30, max_tokens=40, ignore_eos=True))
    s.add_request(GenerateRequest("new", list(range(500, 531)), 40, ignore_eos=True))
    first, _ = run_step(s)
    old_id, new_id = (q.seq_id for q in first.new_seqs)
    preempted_at = None
    for _ in range(10):
        plan, _ = run_step(s)
        if new_id in plan.close:
            preempted_at = plan
            break
    assert preempted_at is not None, "the newest sequence was never preempted"
    assert new_id not in {c.seq_id for c in preempted_at.batch()}
    assert old_id in {c.seq_id for c in preempted_at.batch()}, "the oldest keeps running"
    assert s.queue.peek().request_id == "new" and s.queue.peek().num_preemptions == 1
    assert s.queue.peek().num_computed == 0  # recomputed from scratch when readmitted
    # run everything to the end: both finish, nothing stays referenced
    finished = set()
    for _ in range(200):
        if not s.has_work():
            break
        finished |= {o.request_id for o in run_step(s)[1] if o.finished}
    assert finished == {"old", "new"}
    assert s.cache.usage()["device"]["used"] == 0


def test_requests_admitted_in_one_step_share_their_prefix():
    """Two agents sent the same fresh context at once: the second reads the first's
    blocks, written by the same step (each layer writes the batch's KV before attention)."""
    s = make()
    s.add_request(req("a", n=100))
    s.add_request(req("b", n=100))
    plan = s.schedule()
    assert [len(c.token_ids) for c in plan.batch()] == [100, 4]  # b: its last partial block
    a, b = (s.sequence(r) for r in ("a", "b"))
    assert b.num_device_cached == 96 and b.block_ids[:6] == a.block_ids[:6]


def test_a_long_prefill_reports_its_cached_share_before_its_first_token():
    """So a client's message_start (sent on a keep-alive timer during a long prefill)
    already carries cache_read_input_tokens."""
    s = make(max_num_batched_tokens=32)
    s.add_request(req("a", n=40))
    while s.has_work():
        run_step(s)
    s.add_request(req("b", n=100))  # 32 tokens cached (a's two full blocks), 68 to compute
    _, outs = run_step(s)
    assert [(o.request_id, o.token_ids, o.finished, o.num_device_cached_tokens)
            for o in outs] == [("b", [], False, 32)]
    _, outs = run_step(s)
    assert outs == []  # said once
    s.add_request(GenerateRequest("c", list(range(600, 620)), 4))  # one step: no early output
    assert [o.token_ids for o in run_step(s)[1] if o.request_id == "c"] == [[7]]


def test_a_readmitted_sequence_does_not_count_its_own_blocks_as_hits():
    s = make(num_blocks=5, max_num_batched_tokens=64)
    s.add_request(req("old", n=30, max_tokens=40, ignore_eos=True))
    s.add_request(GenerateRequest("new", list(range(500, 531)), 40, ignore_eos=True))
    outputs = []
    for _ in range(300):
        if not s.has_work():
            break
        outputs += run_step(s)[1]
    assert s.sequence("new") is None and any(o.request_id == "new" for o in outputs)
    done = {o.request_id: o for o in outputs if o.finished}
    assert done["new"].num_device_cached_tokens == 0  # its own recomputed prompt is no hit
    stats = s.cache.stats
    assert stats.num_queried_tokens == 61 and stats.num_device_hit_tokens == 0


def test_a_lone_sequence_that_outgrows_the_tier_stops_with_length():
    s = make(num_blocks=2, max_num_batched_tokens=64)
    s.add_request(req("solo", n=30, max_tokens=100, ignore_eos=True))
    outs = []
    for _ in range(10):
        outs += run_step(s)[1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    # 32 KV slots: the prompt's 30 and two generated tokens; the third is sampled from
    # the last slot's logits and needs no slot until it is fed back
    assert len([o for o in outs if o.token_ids]) == 3


def test_a_sessions_next_prompt_reuses_its_hashes():
    s = make()
    first = req("t0", n=70, max_tokens=2, ignore_eos=True)
    first.session_id = "agent-1"
    s.add_request(first)
    for _ in range(3):
        run_step(s)
    turn2 = GenerateRequest("t1", first.prompt_token_ids + [7, 7] + list(range(500, 540)), 2,
                            session_id="agent-1")
    s.add_request(turn2)
    seq = s.queue.peek()
    assert seq.chain.num_blocks == 4  # 72 shared tokens: 4 full blocks hashed already
    fresh = make()
    fresh.add_request(GenerateRequest("x", turn2.prompt_token_ids, 2))
    fresh_seq = fresh.queue.peek()
    fresh_seq.chain.extend(fresh_seq.tokens)
    seq.chain.extend(seq.tokens)
    assert seq.chain.digests() == fresh_seq.chain.digests()  # same hashes, less work
    # an edited history is noticed: only the blocks before the edit are reused
    edited = list(turn2.prompt_token_ids)
    edited[20] = 999
    s.add_request(GenerateRequest("t2", edited, 2, session_id="agent-1"))
    assert list(s.queue)[-1].chain.num_blocks == 1


def test_plain_decodes_go_column_by_column_and_prefills_as_chunks():
    s = make(max_num_batched_tokens=64)
    prompt = lambda i, n: list(range(100 * i + 10, 100 * i + 10 + n))  # noqa: E731 -- no hits
    s.add_request(GenerateRequest("a", prompt(0, 20), 4))
    s.add_request(GenerateRequest("b", prompt(1, 30), 4))
    first, _ = run_step(s, token=7)
    assert not first.decodes and [len(c.token_ids) for c in first.chunks] == [20, 30]
    s.add_request(GenerateRequest("c", prompt(2, 10), 4))
    plan, _ = run_step(s, token=8)
    d = plan.decodes  # a and b decode their sampled token, c's prompt is a chunk
    assert (d.seq_ids, d.token_ids, d.start_pos) == ([1, 2], [7, 7], [20, 30])
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [(3, 10)]
    assert plan.num_chunks == 3 and [c.seq_id for c in plan.batch()] == [1, 2, 3]


def test_a_running_sequences_output_names_each_field():
    """Sequence.take_output builds a running sequence's output positionally (it runs for
    every sequence, every step): each value must land in its field."""
    s = make()
    s.add_request(req("a", n=20, max_tokens=8))
    run_step(s, token=7)
    seq = s.sequence("a")
    seq.num_device_cached, seq.num_host_cached, seq.num_disk_cached = 16, 32, 48
    seq.num_emitted = 0
    assert seq.take_output() == RequestOutput(
        request_id="a", token_ids=[7], finished=False, finish_reason=None,
        num_prompt_tokens=20, num_device_cached_tokens=16, num_host_cached_tokens=32,
        error=None, error_type=None, num_reasoning_tokens=0, num_disk_cached_tokens=48)


@pytest.mark.parametrize("resumed,max_tokens,message", [
    ([7, 1000], 8, "resumed output token id 1000 is outside the vocabulary"),
    ([7, 7, 7, 7], 4, "leaves nothing to generate"),
    ([7] * 492, 600, "prompt and resumed output are too long: 512 tokens > 511 maximum"),
])
def test_a_continuation_that_cannot_go_on_is_refused(resumed, max_tokens, message):
    with pytest.raises(RequestRejected, match=message):
        make().add_request(req("c", max_tokens=max_tokens, resumed_output=resumed))


def test_a_continuation_goes_ahead_of_new_requests_past_the_bounds_and_counts_its_output():
    """Continued after an engine restart, a request queued or running before is admitted
    before new ones, whatever the queue's bounds; its resumed output is recomputed, never
    sent again, and counts toward max_tokens."""
    s = make(max_queued_requests=1, max_num_seqs=1)
    s.add_request(req("new"))
    s.add_request(req("c1", n=20, max_tokens=5, resumed_output=[7, 8, 9]))
    s.add_request(req("c2", n=24, max_tokens=5, resumed_output=[]))  # it was waiting
    assert [q.request_id for q in s.waiting()] == ["c1", "c2", "new"]
    plan, outs = run_step(s, token=11)
    (chunk,) = plan.chunks  # prompt + resumed output, then a sample at their end
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (0, 23, True)
    assert [(o.request_id, o.token_ids) for o in outs] == [("c1", [11])]
    _, outs = run_step(s, token=12)
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [
        ("c1", [12], "length")]  # 3 resumed + 2: max_tokens


def test_the_budget_table_names_an_fp8_kv_cache(capsys):
    """The start-up table says what a block holds when it is not the model's dtype."""
    from scheduler.main import print_budget

    limits = EngineLimits(100, 64, (0,), num_device_blocks=10, num_host_blocks=5,
                          kv_bytes_per_block=69632)
    print_budget(EngineConfig(model="m", kv_cache_dtype="fp8"), limits)
    printed = " ".join(capsys.readouterr().out.split())  # the title may wrap
    assert "fp8 KV, 69632 B/block/rank" in printed
    print_budget(EngineConfig(model="m"), limits)
    assert "KV," not in " ".join(capsys.readouterr().out.split())
