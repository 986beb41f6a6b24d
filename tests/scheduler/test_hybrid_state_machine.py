"""A hybrid model's state slots under any interleaving of requests, aborts and steps
(planned ahead of the results, as under overlap scheduling, or not): no slot leaks, none
is both free and used, every cached snapshot's hash names one slot, a copy reads a
snapshot and never lands in a slot the ranks still run a sequence in, and the digest the
scheduler predicts equals the one a rank replaying the plans holds, every step.

`HybridDiskMachine` does the same over a disk tier on two ranks (cache/state_disk.py):
snapshots demoted to the host and written through to disk, each rank's reports of its
writes and reads in any order, a sequence that leaves mid-read, and restarts that find
the records every rank holds."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import hypothesis
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.scheduler import Scheduler
from tests.scheduler.test_hybrid_state import Ranks, make
from wire.client import GenerateRequest
from wire.step import StepPlan

# a few shared stems, so prompts hit each other's blocks and snapshots
STEMS = [list(range(10, 110)), list(range(200, 260)), [5] * 70]



def check_live_slots(s: Scheduler, rank_slots: dict[int, int]) -> None:
    """A live slot for exactly the sequences the ranks hold open, the ranks' own."""
    live = s.cache.state.live
    opened = {q.seq_id for q in s.running} | {q.seq_id for q in s._to_close}
    assert set(live) == opened, "a live slot for exactly the sequences the ranks hold"
    assert live == dict(rank_slots)


class _Stepping:
    """What both machines do with the plan whose results are outstanding."""

    s: Scheduler
    in_flight: StepPlan | None

    def finish(self, token: int) -> None:
        plan, self.in_flight = self.in_flight, None
        if plan is not None:
            self.s.update(plan, [(c.seq_id, token) for c in plan.batch() if c.sample])


class HybridMachine(_Stepping, RuleBasedStateMachine):
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
        check_live_slots(self.s, self.ranks.slots)

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


Key = tuple[int, int]
# a rank's disk work, finished in any order: KV and snapshot writes, KV and snapshot reads
KINDS = ("kv_write", "state_write", "kv_read", "state_read")


@dataclass
class DiskRank:
    """One rank's disk tier: the record each slot of its files holds (hash lo, hi), and
    the writes and reads it has queued, (kind, write or read id, disk slot, key, the host
    slot a read fills)."""

    kv: dict[int, Key] = field(default_factory=dict)
    states: dict[int, Key] = field(default_factory=dict)
    queue: list[tuple[str, int, int, Key, int]] = field(default_factory=list)


def agreed(records: list[dict[int, Key]]) -> list[tuple[int, int, int]]:
    """What a restart's scan hands the scheduler: the slots whose record is valid on every
    rank, with the same hash (WorkerReady.disk_found / state_disk_found)."""
    first, *rest = records
    return sorted((slot, *key) for slot, key in first.items()
                  if all(r.get(slot) == key for r in rest))


class HybridDiskMachine(_Stepping, RuleBasedStateMachine):
    """The hybrid state machine over a disk tier on two ranks (world size 2)."""

    @initialize(num_blocks=st.integers(12, 40), num_slots=st.integers(2, 6),
                interval=st.integers(1, 3), max_seqs=st.integers(1, 4),
                host_blocks=st.sampled_from([8, 30]), host_slots=st.integers(1, 4),
                disk_blocks=st.sampled_from([8, 40]), disk_slots=st.integers(1, 8),
                policy=st.sampled_from(["write_back", "write_through"]))
    def start(self, num_blocks: int, num_slots: int, interval: int, max_seqs: int,
              host_blocks: int, host_slots: int, disk_blocks: int, disk_slots: int,
              policy: str) -> None:
        self.sizes = dict(num_blocks=num_blocks, num_state_slots=num_slots,
                          num_host_blocks=host_blocks, num_host_state_slots=host_slots,
                          num_disk_blocks=disk_blocks, num_disk_state_slots=disk_slots,
                          max_num_seqs=max_seqs, max_num_batched_tokens=40,
                          state_snapshot_interval=interval, session_ttl_s=0, world_size=2,
                          kv_write_policy=policy)
        self.disks = [DiskRank(), DiskRank()]  # what outlives a restart
        self.seen: Counter[str] = Counter()  # what happened (`note`)
        self.n = 0
        self.boot()

    def note(self, what: str) -> None:
        """Count what happened: in `hypothesis.event` for the statistics, in `seen` for
        the scripted runs below."""
        self.seen[what] += 1
        if currently_in_test_context():
            hypothesis.event(what)

    def boot(self) -> None:
        """A scheduler and its ranks, new, over the disks as they are."""
        self.s: Scheduler = make(**self.sizes)
        self.ranks = Ranks(self.sizes["num_host_blocks"], self.sizes["num_disk_blocks"])
        self.in_flight: StepPlan | None = None
        self.read_into: set[int] = set()  # host state slots a disk read filled

    @rule(stem=st.integers(0, len(STEMS) - 1), cut=st.integers(1, 99),
          tail=st.lists(st.integers(3, 99), max_size=20), max_tokens=st.integers(1, 24))
    def add(self, stem: int, cut: int, tail: list[int], max_tokens: int) -> None:
        prompt = STEMS[stem][:cut] + tail
        self.s.add_request(GenerateRequest(f"r{self.n}", prompt, max_tokens))
        self.n += 1

    @rule(stem=st.integers(0, len(STEMS) - 1), cut=st.integers(1, 99),
          tail=st.lists(st.integers(3, 99), max_size=8), max_tokens=st.integers(1, 8))
    def turn(self, stem: int, cut: int, tail: list[int], max_tokens: int) -> None:
        """An agent's turn, run for as many steps as it takes (bounded: its disk reads
        wait for the ranks' reports)."""
        self.add(stem, cut, tail, max_tokens)
        for _ in range(12):
            if not self.s.has_work():
                break
            self.step(7, True)

    @rule(which=st.integers(0, 50))
    def abort(self, which: int) -> None:
        if self.n:
            self.s.abort_request(f"r{which % self.n}")

    @precondition(lambda self: self.s._reading)
    @rule(which=st.integers(0, 9))
    def abort_mid_read(self, which: int) -> None:
        """A sequence whose disk reads are in flight leaves: its host slots come back once
        every rank has reported the reads."""
        seq = self.s._reading[which % len(self.s._reading)]
        if self.s.cache.state.disk.is_staged(seq.seq_id):
            self.note("aborted mid-read of a snapshot")
        self.s.abort_request(seq.request.request_id)

    @rule(token=st.sampled_from([3, 7, 8]), ahead=st.booleans(), steps=st.integers(1, 4))
    def steps(self, token: int, ahead: bool, steps: int) -> None:
        """A few steps (the disk flow needs several to go device -> host -> disk and
        back), each planned, with `ahead`, before the results of the one in flight come."""
        for _ in range(steps):
            self.step(token, ahead)
            self.consistent()

    def step(self, token: int, ahead: bool) -> None:
        if not ahead:
            self.finish(token)
        if not self.s.has_work() and not self.unreported_writes():
            return
        plan = self.s.schedule()
        self.ranks.apply(plan)
        self.queue_disk_ops(plan)
        self.finish(token)
        self.in_flight = plan

    def unreported_writes(self) -> bool:
        """An idle engine still steps while a disk write is unreported, so that the ranks
        report it (EngineCore.has_unreported_writes)."""
        cache = self.s.cache
        return bool(cache.disk.num_pending or cache.state.disk.pool.num_pending)

    def queue_disk_ops(self, plan: StepPlan) -> None:
        """Each rank takes the plan's disk ops: a write copies the host slot now, a read is
        only of a record every rank holds, and no op touches a host slot that a rank may
        still be reading a record into (a read is over once every rank reported it)."""
        reading = {(kind, host) for d in self.disks for kind, _, _, _, host in d.queue}
        touched = [("state_read", h) for _, h in plan.state_swap_out]
        touched += [("state_read", h) for h, _ in plan.state_swap_in]
        touched += [("state_read", op[1]) for op in plan.state_disk_write]
        touched += [("state_read", op[2]) for op in plan.state_disk_read]
        touched += [("kv_read", h) for _, h in plan.swap_out]
        touched += [("kv_read", h) for h, _ in plan.swap_in]
        touched += [("kv_read", op[1]) for op in plan.disk_write]
        touched += [("kv_read", op[2]) for op in plan.disk_read]
        assert not reading & set(touched), "a host slot used while a rank reads into it"
        told = self.ranks.mirror.disk_state_hashes()
        for wid, _, disk, lo, hi in plan.state_disk_write:
            self.note("a snapshot written to disk")
            assert told[disk] == lo, "a snapshot write from a host slot holding another"
            for rank in self.disks:
                rank.queue.append(("state_write", wid, disk, (lo, hi), -1))
        for wid, _, disk, lo, hi in plan.disk_write:
            for rank in self.disks:
                rank.queue.append(("kv_write", wid, disk, (lo, hi), -1))
        if plan.state_swap_in:
            self.note("a snapshot restored from the host")
        if any(host in self.read_into for host, _ in plan.state_swap_in):
            self.note("a snapshot read from disk restored")
        self.read_into |= {host for _, _, host, _, _ in plan.state_disk_read}
        if plan.state_disk_read and self.s.cache.state.disk.pool.num_found_at_start:
            self.note("a snapshot read from disk after a restart")
        for kind, ops, held in (("state_read", plan.state_disk_read, "states"),
                                ("kv_read", plan.disk_read, "kv")):
            for rid, disk, host, lo, hi in ops:
                if kind == "state_read":
                    self.note("a snapshot read from disk")
                for rank in self.disks:
                    assert getattr(rank, held).get(disk) == (lo, hi), (
                        f"a {kind} of disk slot {disk}, not written on every rank")
                    rank.queue.append((kind, rid, disk, (lo, hi), host))

    @precondition(lambda self: any(d.queue for d in self.disks))
    @rule(rank=st.integers(0, 1),
          picks=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 4)), min_size=1,
                         max_size=6))
    def report(self, rank: int, picks: list[tuple[int, int]]) -> None:
        """One rank reports some of its writes and reads, in any order, each done or (one
        in five) dropped or bad, as its next step result would."""
        disk = self.disks[rank]
        done: dict[str, list[int]] = {k: [] for k in KINDS}
        failed: dict[str, list[int]] = {k: [] for k in KINDS}
        for i, outcome in picks:
            if not disk.queue:
                break
            kind, op_id, slot, key, _ = disk.queue.pop(i % len(disk.queue))
            ok = outcome != 0
            (done if ok else failed)[kind].append(op_id)
            if ok and kind == "kv_write":
                disk.kv[slot] = key
            elif ok and kind == "state_write":
                disk.states[slot] = key
            elif not ok and kind.startswith("state"):
                self.note(f"a snapshot {kind} failed on one rank")
        self.report_all(rank, done, failed)

    @rule()
    def disks_catch_up(self) -> None:
        """Every rank finishes everything it has queued, and reports it."""
        for rank, disk in enumerate(self.disks):
            if disk.queue:
                self.report(rank, [(0, 1)] * len(disk.queue))

    def report_all(self, rank: int, done: dict[str, list[int]],
                   failed: dict[str, list[int]]) -> None:
        cache = self.s.cache
        cache.report_disk_writes(rank, done["kv_write"], failed["kv_write"], done["kv_read"],
                                 failed["kv_read"])
        cache.report_state_disk(rank, done["state_write"], failed["state_write"],
                                done["state_read"], failed["state_read"])

    @precondition(lambda self: self.s.cache.state.disk.pool.num_committed)
    @rule(fates=st.lists(st.integers(0, 2), max_size=8))
    def restart(self, fates: list[int]) -> None:
        """The engine restarts over the same disk files. A queued write is lost (the old
        record stays), lands, or is torn (its record fails the scan); reads in flight are
        gone. The new scheduler is told the records every rank holds, as at a warm start."""
        for disk in self.disks:
            for kind, _, slot, key, _ in disk.queue:
                fate = fates.pop(0) if fates else 1
                records = disk.kv if kind == "kv_write" else disk.states
                if kind.endswith("write") and fate == 1:
                    records[slot] = key
                elif kind.endswith("write") and fate == 2:
                    records.pop(slot, None)
            disk.queue = []
        self.boot()
        found = agreed([d.kv for d in self.disks])
        self.s.restore_disk(found)
        self.ranks.mirror.restore_disk([s for s, _, _ in found], [lo for _, lo, _ in found])
        found = agreed([d.states for d in self.disks])
        if found:
            self.note("snapshots found after a restart")
        self.s.restore_disk_states(found)
        self.ranks.mirror.restore_disk_states([s for s, _, _ in found],
                                              [lo for _, lo, _ in found])

    @precondition(lambda self: self.s.cache.state.disk.pool.num_committed)
    @rule(stem=st.integers(0, len(STEMS) - 1), caught_up=st.booleans(),
          fates=st.lists(st.integers(0, 2), max_size=8), max_tokens=st.integers(1, 8))
    def resume_after_restart(self, stem: int, caught_up: bool, fates: list[int],
                             max_tokens: int) -> None:
        """An agent's session comes back after a restart (the disks caught up before it,
        or not): its prefix is on disk only."""
        if caught_up:
            self.disks_catch_up()
        self.restart(fates)
        self.add(stem, len(STEMS[stem]), [], max_tokens)
        self.step(7, False)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "s"):
            return
        mirror, cache = self.ranks.mirror, self.s.cache
        assert mirror.value == self.s.digest.value
        assert mirror.state_hashes() == cache.state.registered()
        host_told = mirror.host_state_hashes()
        for slot, lo in cache.state.host.registered().items():
            assert host_told.get(slot) == lo, f"host state slot {slot} holds another snapshot"
        cache.check_invariants()  # HostStates.check and StateDisk.check among them
        self.s.check_accounting()
        for u in cache.state_usage().values():  # what /metrics reports
            assert min(u.values()) >= 0 and u["used"] + u["cached"] + u["free"] == u["capacity"]
        pool = cache.state.disk.pool
        slots = pool.index.registered_items()  # committed or pending
        keys = zip(*(k.tolist() for k in pool.index.keys_of(slots)))
        disk_told = mirror.disk_state_hashes()
        for slot, (lo, hi) in zip(slots.tolist(), keys):
            assert disk_told.get(slot) == lo, f"disk state slot {slot} holds another record"
            if not pool.pending[slot]:  # committed: every rank wrote it
                assert all(d.states.get(slot) == (lo, hi) for d in self.disks)
        check_live_slots(self.s, self.ranks.slots)

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for i in range(self.n):
            self.s.abort_request(f"r{i}")
        for _ in range(8):  # the closes planned; every rank reports all it has queued
            self.finish(7)
            self.disks_catch_up()
            if not self.s.has_work() and not self.unreported_writes():
                break
            self.step(7, False)
        self.consistent()
        cache = self.s.cache
        pool, host, disk = cache.state, cache.state.host, cache.state.disk
        assert not self.s.has_work() and not any(d.queue for d in self.disks)
        assert pool.live == {} and pool.num_pending == 0
        assert pool.num_free + pool.num_cached == pool.num_slots
        assert host.num_free + host.num_cached == host.num_slots, "a host slot still read into"
        assert disk.pool.num_pending == 0 and not disk.pool.reading.any()
        assert cache.host.num_reserved == 0 and not cache.disk.reading.any()
        assert cache.disk.num_pending == 0


HybridDiskMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_hybrid_disk_state_machine = HybridDiskMachine.TestCase


# --- the disk flows, scripted: what every run covers, whatever the machine draws --------


def session_on_disk() -> HybridDiskMachine:
    """Three agents' turns on a device with two state slots: the first's snapshots are
    demoted to the host and written through to disk, and every rank wrote them; the engine
    restarts and the first agent comes back, its snapshot and its KV on disk only: their
    reads start, and the sequence waits for them."""
    m = HybridDiskMachine()
    m.start(num_blocks=30, num_slots=2, interval=1, max_seqs=1, host_blocks=30, host_slots=2,
            disk_blocks=40, disk_slots=8, policy="write_through")
    for stem in range(len(STEMS)):
        m.turn(stem, 99, [], 2)
        m.consistent()
    assert m.seen["a snapshot written to disk"]
    m.resume_after_restart(0, True, [], 2)
    m.consistent()
    assert m.seen["snapshots found after a restart"] and m.seen["a snapshot read from disk"]
    assert m.s._reading
    return m


def land(m: HybridDiskMachine, rank: int, kinds: tuple[str, ...], fail: bool = False) -> None:
    """``rank`` reports each of its reads or writes of these kinds (done, or bad/dropped)."""
    queue = m.disks[rank].queue
    picks = [(i, 0 if fail else 1) for i in reversed(range(len(queue))) if queue[i][0] in kinds]
    m.report(rank, picks)
    m.consistent()


def test_a_snapshot_read_from_disk_is_restored_once_every_rank_reported_it():
    m = session_on_disk()
    land(m, 1, ("kv_read", "state_read"))
    m.steps(7, False, 2)
    assert m.s._reading, "admitted before rank 0 read its records"
    assert not m.seen["a snapshot read from disk restored"]
    land(m, 0, ("kv_read", "state_read"))
    m.steps(7, False, 2)
    assert m.seen["a snapshot read from disk restored"] and not m.s._reading
    m.teardown()


def test_a_snapshot_record_bad_on_one_rank_leaves_the_index():
    m = session_on_disk()
    land(m, 0, ("kv_read", "state_read"))
    land(m, 1, ("kv_read",))
    land(m, 1, ("state_read",), fail=True)
    disk = m.s.cache.state.disk.pool
    m.steps(7, False, 1)
    assert disk.num_bad_reads == 1
    assert not m.seen["a snapshot read from disk restored"], "a bad snapshot restored"
    m.disks_catch_up()  # a read of the snapshot before it, if one started
    m.steps(7, False, 2)
    assert not m.s._reading
    m.teardown()


def test_a_sequence_cancelled_mid_read_frees_its_host_slot_once_every_rank_reported():
    m = session_on_disk()
    host = m.s.cache.state.host
    free = host.num_free
    land(m, 0, ("kv_read", "state_read"))
    m.abort_mid_read(0)
    m.consistent()
    assert m.seen["aborted mid-read of a snapshot"]
    assert host.num_free == free, "freed while rank 1 may still be reading into it"
    land(m, 1, ("kv_read", "state_read"))
    assert host.num_free == free + 1
    m.teardown()
