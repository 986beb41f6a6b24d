"""A hybrid model's state slots in the scheduler alone (no model, no ranks): each sequence
runs in a live slot, chunks snapshot the state at block boundaries, a later prompt with
the same prefix restores the last snapshot and computes the rest, and every slot comes
back after the closes (cache/state_pool.py, scheduler/state_snapshots.py)."""

from __future__ import annotations

import random

import pytest

from scheduler.scheduler import Scheduler
from scheduler.state_snapshots import snapshot_boundaries
from wire.client import GenerateRequest
from wire.config import SNAPSHOT_INTERVAL_AUTO, EngineConfig
from wire.digest import StateDigest
from wire.lifecycle import EngineLimits
from wire.step import StepPlan

BS = 16


def make(num_blocks: int = 64, num_state_slots: int = 16, num_host_blocks: int = 0,
         num_host_state_slots: int = 0, num_disk_blocks: int = 0,
         num_disk_state_slots: int = 0, **cfg) -> Scheduler:
    config = EngineConfig(model="/models/m", block_size=BS, **cfg)
    # the interval the ranks would report: the one asked, else 4 (what `auto` gives a
    # snapshot worth at most 4 blocks)
    return Scheduler(config, EngineLimits(vocab_size=1000, max_model_len=1024,
                                          eos_token_ids=(3,), num_device_blocks=num_blocks,
                                          num_host_blocks=num_host_blocks,
                                          num_disk_blocks=num_disk_blocks,
                                          num_state_slots=num_state_slots,
                                          state_bytes_per_slot=4096,
                                          num_host_state_slots=num_host_state_slots,
                                          num_disk_state_slots=num_disk_state_slots,
                                          state_snapshot_interval=(
                                              config.state_snapshot_interval or 4)))


class Ranks:
    """What the ranks would hold of the state: each plan's digest replayed, and the live
    slot of every open sequence (as a rank remembers it from NewSequence)."""

    def __init__(self, num_host_blocks: int = 0, num_disk_blocks: int = 0) -> None:
        self.mirror = StateDigest(64, num_host_blocks, num_disk_blocks)
        self.slots: dict[int, int] = {}
        self.copies = 0
        self.swaps_in = 0

    def apply(self, plan: StepPlan) -> None:
        cached = self.mirror.state_hashes()
        # demoted: snapshots the device holds, each to its own host slot (the swap_outs run
        # first: a swap_in of the same plan may restore one of them)
        for slot, _ in plan.state_swap_out:
            assert cached.get(slot), f"a swap_out of slot {slot}, which holds no snapshot"
        host_targets = [h for _, h in plan.state_swap_out]
        assert len(set(host_targets)) == len(host_targets), "a host slot written twice"
        on_host = self.mirror.host_state_hashes()
        on_host.update((h, cached[s]) for s, h in plan.state_swap_out)
        for host, dst in plan.state_swap_in:
            assert on_host.get(host), f"a swap_in from host slot {host}, which holds nothing"
            assert dst not in self.slots.values(), f"a swap_in into slot {dst}, live on the ranks"
        restored = [d for _, d in plan.state_copy] + [d for _, d in plan.state_swap_in]
        assert len(set(restored)) == len(restored), "two restores into one slot"
        self.swaps_in += len(plan.state_swap_in)
        for src, dst in plan.state_copy:  # applied before the closes
            assert cached.get(src), f"a copy from slot {src}, which holds no snapshot"
            assert dst not in self.slots.values(), f"a copy into slot {dst}, live on the ranks"
        self.copies += len(plan.state_copy)
        for seq_id in plan.close:
            del self.slots[seq_id]
        for new in plan.new_seqs:
            assert new.state_slot >= 0, f"seq {new.seq_id} opened without a state slot"
            assert new.state_slot not in self.slots.values(), "a live slot used twice"
            self.slots[new.seq_id] = new.state_slot
        written = [s for c in plan.chunks for _, s in c.state_snapshots]
        assert len(set(written)) == len(written), "two snapshots into one slot in one step"
        assert not set(written) & set(self.slots.values()), "a snapshot into a live slot"
        self.mirror.apply(plan)


def run(s: Scheduler, ranks: Ranks, token: int = 7, steps: int = 1) -> list[StepPlan]:
    plans = []
    for _ in range(steps):
        plan = s.schedule()
        ranks.apply(plan)
        assert ranks.mirror.value == s.digest.value
        assert ranks.mirror.state_hashes() == s.cache.state.registered()
        s.cache.check_invariants()
        s.update(plan, [(c.seq_id, token) for c in plan.batch() if c.sample])
        plans.append(plan)
    return plans


def drain(s: Scheduler, ranks: Ranks, token: int = 7) -> None:
    for _ in range(500):
        if not s.has_work():
            return
        run(s, ranks, token)
    raise AssertionError("the scheduler never ran out of work")


def test_boundaries_are_the_interval_multiples_and_the_last():
    assert snapshot_boundaries(0, 100, BS, 4) == [4, 6]  # 6 blocks: 4 (interval), 6 (last)
    assert snapshot_boundaries(0, 128, BS, 4) == [4, 8]
    assert snapshot_boundaries(100, 120, BS, 4) == [7]
    assert snapshot_boundaries(100, 111, BS, 4) == []  # no boundary crossed
    assert snapshot_boundaries(127, 128, BS, 4) == [8]  # a decode onto a boundary
    assert snapshot_boundaries(0, 200, BS, 1) == list(range(1, 13))


def test_a_prompt_runs_in_a_live_slot_and_snapshots_its_boundaries():
    s, ranks = make(state_snapshot_interval=4), Ranks()
    s.add_request(GenerateRequest("a", list(range(10, 110)), 4, ignore_eos=True))
    (plan,) = run(s, ranks)
    (new,) = plan.new_seqs
    assert new.state_slot == 0
    (chunk,) = plan.chunks
    # 100 tokens: boundaries at 64 (4 blocks, the interval) and 96 (the last full block)
    assert [n for n, _ in chunk.state_snapshots] == [64, 96]
    assert sorted(slot for slot, _ in plan.state_register) == sorted(
        slot for _, slot in chunk.state_snapshots)


def test_a_decode_onto_a_boundary_is_a_chunk_with_a_snapshot_registered_next_step():
    """Under overlap scheduling the decode's token is pending when it is planned: its
    block, and the snapshot at its end, are registered by the next plan."""
    s, ranks = make(), Ranks()
    s.add_request(GenerateRequest("a", list(range(10, 40)), 8, ignore_eos=True))  # 30 tokens
    plans = []
    previous = None
    for _ in range(4):  # each plan made before the results of the one before
        plan = s.schedule()
        ranks.apply(plan)
        assert ranks.mirror.value == s.digest.value
        if previous is not None:
            s.update(previous, [(c.seq_id, 7) for c in previous.batch() if c.sample])
        plans.append(previous := plan)
    first, second, third, fourth = plans
    assert [n for n, _ in first.chunks[0].state_snapshots] == [16]
    # step 1 decodes position 30, step 2 position 31: its state is at the 32-token boundary
    assert len(second.decodes) == 1 and not second.chunks
    (chunk,) = third.chunks
    assert chunk.start_pos == 31 and chunk.token_ids == [-1]
    assert [n for n, _ in chunk.state_snapshots] == [1]
    snap = chunk.state_snapshots[0][1]
    assert snap not in dict(third.state_register)
    assert dict(fourth.state_register).get(snap), "the snapshot was never registered"
    # the latest boundary replaced the one before (16 is not on the interval of 4)
    first_snap = first.chunks[0].state_snapshots[0][1]
    assert dict(third.state_register)[first_snap] == 0
    assert ranks.mirror.state_hashes() == s.cache.state.registered() == {
        snap: dict(fourth.state_register)[snap]}


def test_a_second_request_restores_the_snapshot_and_computes_the_rest():
    s, ranks = make(), Ranks()
    prompt = list(range(10, 110))
    s.add_request(GenerateRequest("a", prompt, 2, ignore_eos=True))
    drain(s, ranks)
    s.add_request(GenerateRequest("b", prompt + list(range(300, 340)), 2, ignore_eos=True))
    (plan,) = run(s, ranks)
    (new,) = plan.new_seqs
    (chunk,) = plan.chunks
    b = s.sequence("b")
    # a's prompt and its first output token (101 tokens): its last full block ends at 96
    assert chunk.start_pos == 96 and b.num_device_cached == 96
    (copy,) = plan.state_copy
    assert copy[1] == new.state_slot
    assert ranks.mirror.state_hashes()[copy[0]], "restored from a registered snapshot"
    drain(s, ranks)
    assert s.cache.state.live == {} and s.cache.state.num_pending == 0


def test_a_hit_is_cut_to_the_last_snapshot_and_the_rest_has_a_reason():
    s, ranks = make(state_snapshot_interval=4), Ranks()
    prompt = list(range(10, 110))  # 6 full blocks: snapshots at 4 and 6
    s.add_request(GenerateRequest("a", prompt, 1, ignore_eos=True))
    drain(s, ranks)
    # shares 5 blocks and a bit with a: the KV of 5 is cached, the state only at 4
    s.add_request(GenerateRequest("b", prompt[:85] + list(range(500, 540)), 1))
    (plan,) = run(s, ranks)
    b = s.sequence("b")
    assert plan.chunks[0].start_pos == 64 and b.num_device_cached == 64
    assert b.uncached.no_state == 16  # block 5: cached KV, no state at its end
    assert b.uncached.num_tokens == len(b.request.prompt_token_ids) - 64


def test_without_room_for_a_live_slot_a_request_waits():
    s, ranks = make(num_state_slots=2, max_num_seqs=4), Ranks()
    for i in range(3):
        s.add_request(GenerateRequest(f"r{i}", list(range(100 * i + 10, 100 * i + 20)), 3,
                                      ignore_eos=True))
    (plan,) = run(s, ranks)
    assert len(plan.new_seqs) == 2  # the third waits for a slot
    drain(s, ranks)
    assert s.cache.state.num_free == 2


def test_a_preempted_sequence_comes_back_from_its_snapshot():
    # 10 blocks: "old" grows to 7, so "new" is preempted; once "old" ends, "new" finds
    # most of its own blocks still cached, and the state at the last of them
    s, ranks = make(num_blocks=10, max_num_batched_tokens=64, state_snapshot_interval=1), Ranks()
    s.add_request(GenerateRequest("old", list(range(10, 50)), 60, ignore_eos=True))
    s.add_request(GenerateRequest("new", list(range(500, 540)), 60, ignore_eos=True))
    readmitted = []
    for _ in range(200):
        if not s.has_work():
            break
        (plan,) = run(s, ranks)
        new = s.sequence("new")
        if new is not None and new.num_preemptions and any(
                n.seq_id == new.seq_id for n in plan.new_seqs):
            readmitted.append(plan)
    (plan,) = readmitted
    (copy,) = plan.state_copy
    assert plan.chunks[-1].start_pos > 0 and copy[1] == plan.new_seqs[0].state_slot
    assert s.cache.state.live == {} and s.cache.state.num_pending == 0


def test_a_random_workload_leaks_no_slot_and_the_digest_agrees():
    rng = random.Random(5)
    s, ranks = make(num_blocks=40, num_state_slots=10, max_num_seqs=4,
                    max_num_batched_tokens=48, state_snapshot_interval=2), Ranks()
    stems = [list(range(10, 10 + rng.randrange(20, 90))) for _ in range(3)]
    n = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.15:
            prompt = rng.choice(stems)[:rng.randrange(5, 90)] + [rng.randrange(100, 900)
                                                                   for _ in range(5)]
            s.add_request(GenerateRequest(f"r{n}", prompt, rng.randrange(1, 30)))
            n += 1
        if step < 300 and n and rng.random() < 0.05:
            s.abort_request(f"r{rng.randrange(n)}")
        if s.has_work():
            run(s, ranks, token=rng.choice([3, 7, 8, 9]))
    drain(s, ranks)
    pool = s.cache.state
    assert pool.live == {} and pool.num_pending == 0
    assert pool.num_free + pool.num_cached == pool.num_slots
    assert s.cache.stats.num_device_hit_tokens > 0 and ranks.copies > 0


def test_with_a_host_tier_evicted_snapshots_come_back_from_it():
    rng = random.Random(6)
    s = make(num_blocks=24, num_state_slots=6, num_host_blocks=48, num_host_state_slots=8,
             max_num_seqs=2, max_num_batched_tokens=48, state_snapshot_interval=2)
    ranks = Ranks(48)
    stems = [list(range(10 + 100 * i, 10 + 100 * i + rng.randrange(40, 90))) for i in range(4)]
    for n in range(40):
        prompt = rng.choice(stems) + [rng.randrange(500, 900) for _ in range(5)]
        s.add_request(GenerateRequest(f"r{n}", prompt, rng.randrange(1, 8)))
        drain(s, ranks, token=rng.choice([7, 8, 9]))
        assert ranks.mirror.host_state_hashes() == s.cache.state.host.registered()
    assert ranks.swaps_in > 0, "no hit restored its state from the host"
    pool = s.cache.state
    assert pool.live == {} and pool.num_pending == 0
    assert pool.num_free + pool.num_cached == pool.num_slots


def test_agents_sent_one_fresh_prompt_at_once_wait_a_step_for_its_snapshot():
    """Four agents send the same new 100-token prompt together: the first computes it, and
    the others, whose KV hit the first's blocks at once but whose state snapshot only its
    forward writes, are admitted one step later restoring it (a dense model's KV is read
    in the same forward; a snapshot is not), instead of computing the prompt again."""
    s, ranks = make(state_snapshot_interval=4), Ranks()
    prompt = list(range(10, 110))
    for i in range(4):
        s.add_request(GenerateRequest(f"a{i}", prompt, 2, ignore_eos=True))
    first, second = run(s, ranks, steps=2)
    assert [c.start_pos for c in first.chunks] == [0]
    restored = [c for c in second.chunks if c.start_pos > 0]
    assert [c.start_pos for c in restored] == [96, 96, 96] and len(second.state_copy) == 3
    drain(s, ranks)
    assert s.cache.stats.num_device_hit_tokens == 3 * 96


def test_the_scheduler_snapshots_at_the_interval_the_ranks_report():
    """Under `auto` (the config's 0) the interval is the ranks' choice, in EngineLimits:
    the scheduler plans at it. An explicit one the ranks did not take is a bug."""
    limits = EngineLimits(vocab_size=1000, max_model_len=1024, eos_token_ids=(3,),
                          num_device_blocks=64, num_host_blocks=0, num_state_slots=16,
                          state_bytes_per_slot=4096, state_snapshot_interval=3)
    s, ranks = Scheduler(EngineConfig(model="/models/m", block_size=BS), limits), Ranks()
    assert s.config.state_snapshot_interval == SNAPSHOT_INTERVAL_AUTO
    s.add_request(GenerateRequest("a", list(range(10, 110)), 4, ignore_eos=True))
    (plan,) = run(s, ranks)
    (chunk,) = plan.chunks
    # 100 tokens: boundaries at 48 (3 blocks, the interval) and 96 (6: both)
    assert [n for n, _ in chunk.state_snapshots] == [48, 96]
    with pytest.raises(AssertionError, match="snapshot every 3 blocks, not the 4 asked"):
        Scheduler(EngineConfig(model="/models/m", block_size=BS, state_snapshot_interval=4),
                  limits)


def test_a_retained_sessions_snapshots_outlive_the_one_offs_that_fill_the_slots():
    """A session's turn that ended in a tool call is retained (KV and state alike): one-off
    sessions that need the state slots evict each other's snapshots, not its, though its
    are the oldest, so its next turn restores its whole history (cache/state_host.py
    `least_valuable`). Plenty of KV: only the state slots are short."""
    for ttl in (90.0, 0.0):  # with no --session-ttl the plain LRU takes the oldest: its own
        s, ranks = make(num_blocks=64, num_state_slots=6, max_num_seqs=1,
                        state_snapshot_interval=4, session_ttl_s=ttl,
                        max_retained_fraction=1.0), Ranks()
        turn = list(range(10, 110))  # 100 tokens, 4 answered: snapshots at blocks 4 and 6
        s.add_request(GenerateRequest("s1", turn, 4, ignore_eos=True, session_id="s"))
        drain(s, ranks)
        s.end_turn("s1", tool_call=True)
        for i in range(3):  # each one's 2 snapshots need a slot the others hold
            s.add_request(GenerateRequest(f"o{i}", list(range(200 + 100 * i, 300 + 100 * i)),
                                          4, ignore_eos=True, session_id=f"o{i}"))
            drain(s, ranks)
            s.end_turn(f"o{i}", tool_call=False)
        s.add_request(GenerateRequest("s2", turn + [7] * 4 + list(range(600, 630)), 4,
                                      ignore_eos=True, session_id="s"))
        run(s, ranks)
        # its 104 tokens: 6 full blocks, the last snapshot's
        assert s.sequence("s2").num_device_cached == (96 if ttl else 0), ttl
        drain(s, ranks)
