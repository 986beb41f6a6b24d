"""A hybrid model's state slots under any interleaving of requests, aborts and steps
(planned ahead of the results, as under overlap scheduling, or not): no slot leaks, none
is both free and used, every cached snapshot's hash names one slot, a copy reads a
snapshot and never lands in a slot the ranks still run a sequence in, and the digest the
scheduler predicts equals the one a rank replaying the plans holds, every step."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler.scheduler import Scheduler
from tests.scheduler.test_hybrid_state import Ranks, make
from wire.client import GenerateRequest
from wire.step import StepPlan

# a few shared stems, so prompts hit each other's blocks and snapshots
STEMS = [list(range(10, 110)), list(range(200, 260)), [5] * 70]


class HybridMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(12, 40), num_slots=st.integers(2, 12),
                interval=st.integers(1, 4), max_seqs=st.integers(1, 4),
                host_blocks=st.sampled_from([0, 0, 8, 30]), host_slots=st.integers(1, 6))
    def start(self, num_blocks: int, num_slots: int, interval: int, max_seqs: int,
              host_blocks: int, host_slots: int) -> None:
        """With host_blocks, a host tier: snapshots the device evicts go down to it."""
        self.s: Scheduler = make(num_blocks=num_blocks, num_state_slots=num_slots,
                                 num_host_blocks=host_blocks,
                                 num_host_state_slots=host_slots if host_blocks else 0,
                                 max_num_seqs=max_seqs, max_num_batched_tokens=40,
                                 state_snapshot_interval=interval, session_ttl_s=0)
        self.ranks = Ranks(host_blocks)
        self.in_flight: StepPlan | None = None
        self.n = 0

    @rule(stem=st.integers(0, len(STEMS) - 1), cut=st.integers(1, 100),
          tail=st.lists(st.integers(300, 999), max_size=20), max_tokens=st.integers(1, 24))
    def add(self, stem: int, cut: int, tail: list[int], max_tokens: int) -> None:
        prompt = STEMS[stem][:cut] + tail
        self.s.add_request(GenerateRequest(f"r{self.n}", prompt, max_tokens))
        self.n += 1

    @rule(which=st.integers(0, 50))
    def abort(self, which: int) -> None:
        if self.n:
            self.s.abort_request(f"r{which % self.n}")

    @rule(token=st.sampled_from([3, 7, 8]), ahead=st.booleans())
    def step(self, token: int, ahead: bool) -> None:
        """Plan a step; with `ahead`, before the results of the one in flight come."""
        if not ahead or self.s.needs_tokens():
            self.finish(token)
        if not self.s.has_work():
            return
        plan = self.s.schedule()
        self.ranks.apply(plan)
        self.finish(token)
        self.in_flight = plan

    def finish(self, token: int) -> None:
        plan, self.in_flight = self.in_flight, None
        if plan is not None:
            self.s.update(plan, [(c.seq_id, token) for c in plan.batch() if c.sample])

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "s"):
            return
        assert self.ranks.mirror.value == self.s.digest.value
        assert self.ranks.mirror.state_hashes() == self.s.cache.state.registered()
        host = self.s.cache.state.host
        assert self.ranks.mirror.host_state_hashes() == (
            host.registered() if host is not None else {})
        self.s.cache.check_invariants()  # StatePool.check: every slot in one state
        self.s.check_accounting()
        live = self.s.cache.state.live
        opened = {q.seq_id for q in self.s.running} | {q.seq_id for q in self.s._to_close}
        assert set(live) == opened, "a live slot for exactly the sequences the ranks hold"
        assert live == {sid: slot for sid, slot in self.ranks.slots.items()}

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for i in range(self.n):
            self.s.abort_request(f"r{i}")
        for _ in range(5):
            self.step(7, False)
        self.finish(7)
        pool = self.s.cache.state
        assert not self.s.has_work()
        assert pool.live == {} and pool.num_pending == 0
        assert pool.num_free + pool.num_cached == pool.num_slots
        if pool.host is not None:
            assert pool.host.num_free + pool.host.num_cached == pool.host.num_slots


HybridMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_hybrid_state_machine = HybridMachine.TestCase
