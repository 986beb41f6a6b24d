"""`deepinfer-inspect check`: do the ranks hold what the scheduler planned, and the same?

The engine keeps stepping while it is asked, so one round asks the scheduler, every
rank, then the scheduler again; the round is *aligned* when the scheduler did not plan
a step in between and every rank has applied that step's table deltas (a rank in the
forward pass of step k holds the same tables as one that finished it). Only aligned
rounds compare block tables and tier contents, and a difference counts only when the
next aligned round shows it again (a round may still catch a process mid-update).
Under overlap scheduling the scheduler is always a plan ahead of the ranks, so each
scheduler snapshot holds overlap off for a moment (scheduler/control.py OVERLAP_HOLD_S)
and the rounds after the first can align.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tools.inspection.client import EngineAddresses, ask_all
from wire.control import (
    RankSnapshot,
    SchedulerSnapshot,
    SeqRequest,
    SeqView,
    SnapshotRequest,
    TierContents,
    TierRequest,
)
from wire.control_server import ControlUnavailable, ask

MAX_TIER_ENTRIES = 1 << 22  # compared entry by entry; beyond, only the tier digest
TIER_SLICE = 1 << 20
MAX_TIER_DIFFS = 5


@dataclass
class Difference:
    kind: str  # unreachable | failed | step | digest | live_seqs | block_table | tier
    process: str  # "rank 2", or "scheduler"
    detail: str
    seq_id: int | None = None
    index: int | None = None  # block-table index, or the block / host slot of a tier
    tier: str | None = None
    value: Any = None  # what the process holds there
    expected: Any = None  # what the reference (the scheduler) holds there

    def key(self) -> tuple:
        return (self.kind, self.process, self.seq_id, self.index, self.tier, self.value,
                self.expected)


@dataclass
class CheckResult:
    agree: bool
    step: int | None
    aligned: bool
    attempts: int
    differences: list[Difference] = field(default_factory=list)
    # a hybrid model's state tables as each process holds them: process -> table
    # (wire/digest.py STATE_TIERS) -> the slots told to hold a snapshot; compared, with
    # the tier contents, through the tables' digests
    state_entries: dict[str, dict[str, int]] = field(default_factory=dict)


# What compare() needs beyond the snapshots: (process, seq id) -> its view of the sequence;
# (process, tier, start, stop) -> hashes held there.
SeqFetcher = Callable[[str, int], SeqView]
TierFetcher = Callable[[str, str, int, int], list[int]]


def compare(sched: Any, ranks: dict[str, Any], aligned: bool, fetch_seq: SeqFetcher,
            fetch_tier: TierFetcher) -> list[Difference]:
    """Differences between each rank and the reference (the scheduler's plan; the first
    rank that answered when the scheduler did not)."""
    diffs: list[Difference] = []
    live: dict[str, RankSnapshot] = {}
    for name, snap in [("scheduler", sched), *ranks.items()]:
        if isinstance(snap, Exception):
            diffs.append(Difference("unreachable", name, str(snap)))
        elif snap.state == "failed":
            diffs.append(Difference("failed", name, snap.last_error or "failed"))
        if not isinstance(snap, Exception) and name != "scheduler":
            live[name] = snap
    if isinstance(sched, SchedulerSnapshot):
        ref_name, ref_step = "scheduler", sched.step
        ref_seqs, ref_tiers = {s.seq_id: s for s in sched.seqs}, sched.tier_digests
    elif live:
        ref_name, first = next(iter(live.items()))
        ref_step, ref_seqs, ref_tiers = first.step, {s.seq_id: s for s in first.seqs}, \
            first.tier_digests
    else:
        return diffs
    for name, r in live.items():
        if name == ref_name:
            continue
        if not aligned:
            if r.step != ref_step:
                diffs.append(Difference("step", name, f"at step {r.step} ({r.state}, "
                                        f"{r.seconds_in_step:.1f}s in step), {ref_name} at "
                                        f"step {ref_step}", value=r.step, expected=ref_step))
            continue
        if (isinstance(sched, SchedulerSnapshot) and r.state == "idle"
                and r.digest != sched.expected_digest):
            diffs.append(Difference("digest", name, f"step {r.step} digest {r.digest:#018x}, "
                                    f"scheduler expects {sched.expected_digest:#018x}",
                                    value=r.digest, expected=sched.expected_digest))
        diffs += _compare_tables(name, r, ref_name, ref_seqs, fetch_seq)
        for tier, expected in ref_tiers.items():
            if r.tier_digests.get(tier) != expected:
                capacity = r.usage.get(tier, {}).get("capacity", r.state_slots.get(tier, 0))
                diffs += _compare_tier(name, ref_name, tier, capacity, fetch_tier)
    return diffs


def _compare_tables(name: str, r: RankSnapshot, ref_name: str, ref_seqs: dict,
                    fetch_seq: SeqFetcher) -> list[Difference]:
    diffs = []
    mine = {s.seq_id: s for s in r.seqs}
    extra, missing = sorted(set(mine) - set(ref_seqs)), sorted(set(ref_seqs) - set(mine))
    if extra or missing:
        diffs.append(Difference("live_seqs", name, f"holds seqs {extra} that {ref_name} does "
                                f"not; lacks {missing}", value=extra, expected=missing))
    for sid in sorted(set(mine) & set(ref_seqs)):
        a, b = mine[sid], ref_seqs[sid]
        if (a.num_blocks, a.table_digest) == (b.num_blocks, b.table_digest):
            continue
        got, want = fetch_seq(name, sid).block_ids, fetch_seq(ref_name, sid).block_ids
        i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got),
                                                                               len(want)))
        value = got[i] if i < len(got) else None
        expected = want[i] if i < len(want) else None
        diffs.append(Difference(
            "block_table", name, f"seq {sid} table index {i}: block {value}, {ref_name} has "
            f"block {expected} ({len(got)} vs {len(want)} blocks)", seq_id=sid, index=i,
            value=value, expected=expected))
    return diffs


def _compare_tier(name: str, ref_name: str, tier: str, capacity: int,
                  fetch_tier: TierFetcher) -> list[Difference]:
    if capacity > MAX_TIER_ENTRIES:
        return [Difference("tier", name, f"{tier} tier contents differ (too large to list)",
                           tier=tier)]
    diffs = []
    for start in range(0, capacity, TIER_SLICE):
        stop = min(capacity, start + TIER_SLICE)
        got, want = fetch_tier(name, tier, start, stop), fetch_tier(ref_name, tier, start, stop)
        for i, (x, y) in enumerate(zip(got, want)):
            if x != y and len(diffs) < MAX_TIER_DIFFS:
                unit = "block" if tier == "device" else "slot"
                diffs.append(Difference(
                    "tier", name, f"{tier} {unit} {start + i} holds hash {x:#018x}, "
                    f"{ref_name} has {y:#018x}", index=start + i, tier=tier, value=x,
                    expected=y))
    return diffs or [Difference("tier", name, f"{tier} tier digest differs", tier=tier)]


def state_entries(sched: Any, ranks: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Process -> its state tables' entries, for the processes that answered and keep a
    hybrid model's state (none for any other model)."""
    return {name: snap.state_entries for name, snap in [("scheduler", sched), *ranks.items()]
            if not isinstance(snap, Exception) and snap.state_entries}


def run_check(engine: EngineAddresses, timeout_s: float = 5.0, max_rounds: int = 40,
              interval_s: float = 0.05) -> CheckResult:
    named = engine.named()
    rank_addrs = {n: a for n, a in named.items() if n != "scheduler"}

    def snap_scheduler() -> Any:
        try:
            return ask(engine.scheduler, SnapshotRequest(detail=True), timeout_s)
        except ControlUnavailable as exc:
            return exc

    def fetch_seq(name: str, seq_id: int) -> SeqView:
        return ask(named[name], SeqRequest(seq_id), timeout_s)

    def fetch_tier(name: str, tier: str, start: int, stop: int) -> list[int]:
        reply: TierContents = ask(named[name], TierRequest(tier, start, stop), timeout_s)
        return reply.hashes

    confirmed: set[tuple] | None = None
    diffs: list[Difference] = []
    for attempt in range(1, max_rounds + 1):
        s1 = snap_scheduler()
        ranks = ask_all(rank_addrs, SnapshotRequest(detail=True), timeout_s)
        s2 = snap_scheduler()
        answered = [x for x in [s1, s2, *ranks.values()] if not isinstance(x, Exception)]
        unreachable = len(answered) < 2 + len(ranks)
        aligned = not unreachable and s1.step == s2.step and all(
            r.step == s1.step for r in ranks.values())
        if not aligned and not unreachable and attempt < max_rounds:
            time.sleep(interval_s)
            continue
        try:
            diffs = compare(s1, ranks, aligned, fetch_seq, fetch_tier)
        except ControlUnavailable:  # a process went away mid-check: ask again
            continue
        step = None if isinstance(s1, Exception) else s1.step
        keys = {d.key() for d in diffs}
        states = state_entries(s1, ranks)
        if not diffs or unreachable or not aligned or attempt == max_rounds:
            return CheckResult(not diffs, step, aligned, attempt, diffs, states)
        if confirmed is not None and keys & confirmed:
            return CheckResult(False, step, aligned, attempt,
                               [d for d in diffs if d.key() in confirmed], states)
        confirmed = keys
        time.sleep(interval_s)
    return CheckResult(not diffs, None, False, max_rounds, diffs)
