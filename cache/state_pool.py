"""StatePool: a hybrid model's state slots, as the scheduler sees them (no tensors here).

A linear-attention layer (Gated DeltaNet: Qwen3-Next, Qwen3.5) keeps a fixed-size state
per sequence -- a conv window and a recurrent matrix -- instead of KV pages, so a prefix
hit needs that state as it was at the hit's end. Each rank holds `num_slots` slots of it
(worker/linear_state.py), and every slot is, at any time, exactly one of:

- free;
- *live*: the running state of one open sequence (NewSequence.state_slot);
- *pending*: a snapshot a sequence's chunk takes (ScheduledChunk.state_snapshots) at a
  block boundary whose block is not committed yet (its last token still pending under
  overlap scheduling); registered when the block is (`commit`), freed if the sequence
  closes first;
- *cached*: a snapshot indexed by the hash of the block it ends at (the chain through
  that block: the same key as the block's KV), restored into a live slot by a prefix hit
  (`open`: a StepPlan.state_copy). Pinned while a waiting sequence holds it as its hit;
  else in an LRU, evicted when a slot is wanted, those whose block no tier holds any more
  first (without its KV chain a snapshot is useless), those whose block a tier retains
  last (a retained session's next turn needs its snapshot as much as its KV: without it
  the hit ends at the snapshot before); one whose block is still held is
  demoted to the host tier, if it has one (cache/state_host.py: StepPlan.state_swap_out),
  and written through from there to the disk tier, if that has room for snapshots
  (cache/state_disk.py: StepPlan.state_disk_write; `on_disk` finds them again).

A hit is restored from the device (a copy) or from the host (a swap_in), whichever holds
the snapshot at the hit's last block: `best` names the source as a *restore handle*, a
device slot, or `num_slots` + a host slot, which `pin`, `unpin` and `open` take.

A snapshot registered in a plan is written by that plan's forward, after the plan's
copies ran, so it is hittable (and evictable) only from the next plan on (`take_ops`).
Which slot holds which hash is in the state digest (wire/digest.py): each registration,
and each removal (hash 0) when a cached slot is dropped or reused, is a
StepPlan.state_register pair.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from cache.hashing import BlockHashChain
from cache.state_disk import StateDisk
from cache.state_host import ChainValue, HostStates, Key, least_valuable, unpin

_MATCH_CHUNK = 256  # the prefix is searched from its end in chunks of this many blocks


class StatePool:
    def __init__(self, num_slots: int, chain_value: ChainValue | None = None,
                 num_host_slots: int = 0, num_disk_slots: int = 0, num_ranks: int = 1) -> None:
        self.num_slots = num_slots
        # snapshots the device evicted, while their blocks are still cached somewhere
        self.host = HostStates(num_host_slots, chain_value) if num_host_slots else None
        # ... and written through from there to the disk tier (cache/state_disk.py)
        self.disk = (StateDisk(num_disk_slots, self.host, num_ranks)
                     if self.host is not None and num_disk_slots else None)
        # what each (lo, hi) is worth: dead, held or retained by the KV tiers (cache/manager.py)
        self._chain_value = chain_value
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: 0, 1, 2, ... first
        self.live: dict[int, int] = {}  # seq id -> its live slot
        self._pending: dict[int, list[tuple[int, int]]] = {}  # seq id -> [(blocks, slot)]
        self._latest: dict[int, int] = {}  # seq id -> its own latest snapshot, if dropped on
        self._index: dict[Key, int] = {}  # cached snapshots
        self._key: dict[int, Key] = {}  # cached slot -> its key
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unpinned, ready: oldest first
        self._pins: dict[int, int] = {}  # cached slot -> waiting sequences that will restore it
        # registered this plan, in order: written by its forward
        self._not_ready: dict[int, None] = {}
        self._copies: list[tuple[int, int]] = []
        # Freed by this plan's closes, free for the next plan's: a rank applies a plan's
        # state_copy before its closes, so a copy must not land in a slot the sequence it
        # closes still has on the rank.
        self._released: list[int] = []
        self._registers: dict[int, int] = {}  # this plan's digest pairs, slot -> lo (0: none)
        self._swap_out: list[tuple[int, int]] = []  # (device slot, host slot) demotions
        self._swap_in: list[tuple[int, int]] = []  # (host slot, live slot) restores

    # --- queries --------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._released)

    @property
    def num_cached(self) -> int:
        return len(self._key)

    @property
    def num_pending(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def slot_of(self, seq_id: int) -> int:
        return self.live.get(seq_id, -1)

    def can_open(self) -> bool:
        """Whether `open` would find a live slot (a pinned restore source is not
        evictable, so not counted)."""
        return bool(self._free) or bool(self._lru)

    def best(self, chain: BlockHashChain, num_blocks: int) -> tuple[int, int]:
        """(n, restore): the longest prefix of at most ``num_blocks`` blocks of ``chain``
        (hashed that far) whose state is cached and ready, on the device or the host, and
        the restore handle of the slot holding it (the device's if both hold it);
        (0, -1) if none."""
        host = self.host if self.host is not None and self.host.num_cached else None
        stop = num_blocks
        while stop > 0 and (self._index or host is not None):
            start = max(0, stop - _MATCH_CHUNK)
            lo, hi = chain.keys(start, stop)
            for i, key in enumerate(reversed(list(zip(lo.tolist(), hi.tolist())))):
                slot = self._index.get(key)
                if slot is not None and slot not in self._not_ready:
                    return stop - i, slot
                if host is not None and (h := host.find(key)) >= 0:
                    return stop - i, self.num_slots + h
            stop = start
        return 0, -1

    def written_this_plan(self, chain: BlockHashChain, start: int, stop: int) -> bool:
        """Whether a snapshot at one of blocks (start, stop] of ``chain`` is registered in
        the plan being made: its forward writes it, so the next plan may restore it. A
        sequence whose longer hit waits on one is better admitted then than now (agents
        sent the same fresh system prompt at once: the first computes it, the others
        take it one step later instead of computing it again)."""
        if not self._not_ready or stop <= start:
            return False
        lo, hi = chain.keys(start, stop)
        return any(self._index.get(key) in self._not_ready
                   for key in zip(lo.tolist(), hi.tolist()))

    def on_disk(self, chain: BlockHashChain, num_blocks: int,
                beyond: int) -> tuple[int, int, Key]:
        """(n, disk slot, key): the longest prefix of at most ``num_blocks`` blocks, and
        more than ``beyond``, whose snapshot is committed on disk; (0, -1, (0, 0)) if none."""
        if self.disk is None or num_blocks <= beyond or not self.disk.pool.num_committed:
            return 0, -1, (0, 0)
        lo, hi = chain.keys(beyond, num_blocks)
        slots = self.disk.find(lo, hi)
        found = np.flatnonzero(slots >= 0)
        if not len(found):
            return 0, -1, (0, 0)
        i = int(found[-1])
        return beyond + i + 1, int(slots[i]), (int(lo[i]), int(hi[i]))

    def registered(self) -> dict[int, int]:
        """Cached slot -> its hash's lo word: what the state digest must hold."""
        return {slot: key[0] for slot, key in self._key.items()}

    def usage(self) -> dict[str, dict[str, int]]:
        """Slots per tier, as KVCacheManager.usage counts blocks: used + cached + free ==
        capacity. device: used = a running sequence's live slot, or a snapshot whose block
        is not committed yet; host: used = held for a disk read in flight; disk: used = a
        write in flight, or a bad read's record not yet free; cached = holding a snapshot
        (on disk: committed, readable)."""
        tiers = {"device": (self.num_slots, self.num_cached, self.num_free)}
        if self.host is not None:
            tiers["host"] = (self.host.num_slots, self.host.num_cached, self.host.num_free)
        if self.disk is not None:
            pool = self.disk.pool
            tiers["disk"] = (pool.num_slots, pool.num_committed, pool.num_free)
        return {tier: {"capacity": n, "used": n - cached - free, "cached": cached,
                       "free": free} for tier, (n, cached, free) in tiers.items()}

    # --- sequences --------------------------------------------------------------------

    def pin(self, slot: int) -> None:
        """A waiting sequence will restore this cached snapshot (a restore handle): not
        evictable until `unpin` (or `open`, which unpins it)."""
        if slot >= self.num_slots:
            self.host.pin(slot - self.num_slots)
            return
        assert slot in self._key and slot not in self._not_ready, f"state slot {slot}"
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._lru.pop(slot, None)

    def unpin(self, slot: int) -> None:
        if slot >= self.num_slots:
            self.host.unpin(slot - self.num_slots)
            return
        unpin(self._pins, self._lru, slot)

    def open(self, seq_id: int, restore: int = -1) -> int:
        """The live slot of a sequence admitted now; with ``restore`` (a slot pinned for
        it, so the eviction here cannot take it), a copy of that snapshot into it (from the
        host: a swap_in), and the pin let go."""
        assert seq_id not in self.live, f"seq {seq_id} has a live state slot already"
        assert restore < 0 or (restore in self._pins if restore < self.num_slots
                               else self.host.is_pinned(restore - self.num_slots)), (
            f"state slot {restore} is not pinned")
        slot = self._take()
        assert slot >= 0, "no state slot for an admitted sequence (call can_open first)"
        self.live[seq_id] = slot
        if restore >= self.num_slots:
            self._swap_in.append((restore - self.num_slots, slot))
            self.host.restore(restore - self.num_slots)
        elif restore >= 0:
            self._copies.append((restore, slot))
            self.unpin(restore)
        return slot

    def close(self, seq_id: int) -> None:
        """A sequence closes: its live slot is free, its snapshots not yet registered too
        (their blocks were never committed); the registered ones stay cached."""
        slot = self.live.pop(seq_id, -1)
        if slot >= 0:
            self._released.append(slot)
        for _, snap in self._pending.pop(seq_id, ()):
            self._released.append(snap)
        self._latest.pop(seq_id, None)

    def take_snapshot(self, seq_id: int, num_blocks: int, keep: bool) -> int:
        """A slot for the state of ``seq_id`` after its first ``num_blocks`` blocks, taken
        by this plan's forward and registered once the block is committed (`commit`); -1
        when every slot is in use (no snapshot: a later hit starts further back). Unless
        ``keep`` (a boundary on the snapshot interval), it replaces the sequence's
        previous such snapshot: only its latest boundary is worth a slot."""
        assert seq_id in self.live, f"seq {seq_id} snapshots without a live state slot"
        slot = self._take()
        if slot < 0:
            return -1
        previous = self._latest.pop(seq_id, -1)
        if previous >= 0:
            self._drop_own(seq_id, previous)
        self._pending.setdefault(seq_id, []).append((num_blocks, slot))
        if not keep:
            self._latest[seq_id] = slot
        return slot

    def commit(self, seq_id: int, chain: BlockHashChain, num_registered: int) -> None:
        """Register the snapshots of ``seq_id`` whose block is committed now (the first
        ``num_registered`` blocks, hashed in ``chain``). A hash already cached keeps its
        slot; this one is freed."""
        pending = self._pending.get(seq_id)
        if not pending:
            return
        ready = [(n, slot) for n, slot in pending if n <= num_registered]
        if not ready:
            return
        self._pending[seq_id] = [p for p in pending if p[0] > num_registered]
        for n, slot in ready:
            lo, hi = chain.keys(n - 1, n)
            key = (int(lo[0]), int(hi[0]))
            if key in self._index:  # reusable from the next plan: this one's forward writes it
                self._released.append(slot)
                if self._latest.get(seq_id) == slot:
                    del self._latest[seq_id]
                continue
            self._index[key] = slot
            self._key[slot] = key
            self._not_ready[slot] = None
            self._registers[slot] = key[0]

    # --- per plan ---------------------------------------------------------------------

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This plan's (state_copy, state_register); the snapshots it registered become
        hittable and evictable for the plans after it."""
        copies, self._copies = self._copies, []
        self._free.extend(self._released)
        self._released = []
        registers = list(self._registers.items())
        self._registers = {}
        for slot in self._not_ready:
            if slot in self._key and slot not in self._pins:
                self._lru[slot] = None
        self._not_ready.clear()
        return copies, registers

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This plan's (state_swap_out, state_swap_in), with `take_ops`."""
        swaps = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        if self.host is not None:
            self.host.end_plan()
        return swaps

    def peek_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return list(self._copies), list(self._registers.items())

    def peek_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return list(self._swap_out), list(self._swap_in)

    def drop_cached(self) -> int:
        """Forget every cached snapshot nobody holds (a reset of the prefix cache)."""
        victims = list(self._lru)
        for slot in victims:
            self._unindex(slot)
            self._free.append(slot)
        dropped = len(victims) + (self.host.drop_cached() if self.host is not None else 0)
        if self.disk is not None:  # as the KV disk tier's committed slots are
            dropped += len(self.disk.pool.drop_cached())
        return dropped

    # --- internals ----------------------------------------------------------------------

    def _take(self) -> int:
        """A free slot, else the least valuable cached one (unindexed; demoted to the
        host if its block is still cached somewhere); -1 if none."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return -1
        slot, alive = least_valuable(self._lru, self._key, self._chain_value)
        if alive and self.host is not None:
            host_slot = self.host.demote(self._key[slot])
            if host_slot >= 0:  # the ranks copy it out before anything writes the slot
                self._swap_out.append((slot, host_slot))
                if self.disk is not None:
                    self.disk.write_through(host_slot, self._key[slot])
        self._unindex(slot)
        return slot

    def _unindex(self, slot: int) -> None:
        key = self._key.pop(slot)
        del self._index[key]
        self._lru.pop(slot, None)
        self._not_ready.pop(slot, None)
        self._registers[slot] = 0
        # a running sequence's latest snapshot evicted: none of its own to replace now
        # (the slot goes to another use, which `_drop_own` must not free)
        owner = next((q for q, s in self._latest.items() if s == slot), None)
        if owner is not None:
            del self._latest[owner]

    def _drop_own(self, seq_id: int, slot: int) -> None:
        """Drop a snapshot of ``seq_id`` replaced by a later one: freed if pending or
        cached and unpinned; a pinned one stays (the LRU takes it once let go)."""
        pending = self._pending.get(seq_id, [])
        for i, (_, s) in enumerate(pending):
            if s == slot:
                del pending[i]
                self._released.append(slot)  # this plan's forward may still write it
                return
        if slot in self._key and slot not in self._pins:
            self._unindex(slot)
            self._released.append(slot)

    def check(self) -> None:
        """Every slot in exactly one state; the indexes agree (O(slots): tests)."""
        live = list(self.live.values())
        pending = [s for p in self._pending.values() for _, s in p]
        everything = self._free + self._released + live + pending + list(self._key)
        assert sorted(everything) == list(range(self.num_slots)), (
            f"state slots lost or doubled: free {self._free}, live {live}, pending "
            f"{pending}, cached {sorted(self._key)}")
        assert {v: k for k, v in self._index.items()} == self._key
        assert set(self._pins) <= set(self._key) and all(n > 0 for n in self._pins.values())
        assert set(self._lru) == set(self._key) - set(self._pins) - set(self._not_ready)
        assert set(self._not_ready) <= set(self._key)
        owned = set(pending) | set(self._key)
        assert all(s in owned for s in self._latest.values())
        if self.host is not None:
            self.host.check()
        if self.disk is not None:
            self.disk.check()
