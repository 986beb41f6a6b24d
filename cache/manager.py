"""KVCacheManager: the scheduler's view of every KV block, in both tiers.

The scheduler owns this object; workers never decide anything about cache state. Per
step, the scheduler calls (in this order):

  1. ``free(seq, step)`` for sequences closed this step (never one this step runs: the
     close-timing rule, scheduler/scheduler.py `Scheduler._close`);
  2. ``lookup`` (optional, read-only) and ``allocate`` for sequences it schedules;
  3. ``commit(..., step)`` for every scheduled sequence, with the tokens whose KV this
     step writes;
  4. ``take_ops()`` exactly once, and sends the ops in the step plan.

Workers apply a plan in order: all ``swap_out`` (device block -> host slot), then all
``swap_in`` (host slot -> device block), then block-table deltas and the forward pass,
which writes the new KV of every sequence of the batch (in each layer, before any
attention of that layer reads it). Everything below relies on that order:
  - a block evicted this step can be reused this step (as a swap_in target or for new
    KV) because its swap_out has already copied it;
  - a host slot filled by a swap_out this step can be the source of a swap_in this step;
  - a block committed this step is registered at once, so a sequence admitted in the
    same step can hit it: the KV is written by this step's forward before it is read.

Two collaborators it owns do most of the work: cache/admission.py (a sequence's first
blocks: its prefix hit per tier, holds) and cache/tier_moves.py (the step's ops: blocks
registered, fresh blocks with eviction, copies to the host and the disk).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from cache import checks
from cache.admission import Admission
from cache.block_pool import DevicePool
from cache.disk_flow import DiskFlow
from cache.disk_pool import DiskPool
from cache.events import KVEventRecorder
from cache.eviction_memory import EvictionMemory
from cache.hashing import BlockHashChain
from cache.host_pool import HostPool
from cache.miss_reasons import MissAttribution, PreviousPrompt
from cache.retention import RetentionPolicy
from cache.state_host import DEAD, HELD, RETAINED
from cache.state_pool import StatePool
from cache.stats import CacheStats
from cache.tier_moves import TierMoves
from cache.types import (
    WRITE_POLICIES,
    CacheAccountingError,
    CacheConfig,
    CacheOps,
    PrefixHit,
    SeqEntry,
    as_array,
)
from wire.client import UncachedTokens

__all__ = ["WRITE_POLICIES", "CacheAccountingError", "CacheConfig", "CacheOps",
           "KVCacheManager", "PrefixHit"]


class KVCacheManager:
    def __init__(self, config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        retention = RetentionPolicy(config.max_retained_fraction, clock)
        self.device = DevicePool(config.num_device_blocks, retention)
        self.host = HostPool(config.num_host_blocks if config.host_enabled else 0, retention)
        num_disk_blocks = config.num_disk_blocks if config.disk_enabled else 0
        # what the tiers let go, to tell why a prompt missed (cache/miss_reasons.py)
        drops = EvictionMemory((config.num_device_blocks + self.host.num_slots
                                + num_disk_blocks) if config.enable_prefix_caching else 0,
                               clock)
        self.disk = DiskPool(num_disk_blocks, config.num_ranks, drops)
        self.misses = MissAttribution(self.device, self.host, self.disk, drops,
                                      config.block_size, clock)
        self.stats = CacheStats()
        self._seqs: dict[int, SeqEntry] = {}
        self.events = (KVEventRecorder(config.num_device_blocks, config.block_size)
                       if config.record_events and config.enable_prefix_caching else None)
        self.disk_flow = DiskFlow(self.host, self.disk, config.num_ranks, self.stats,
                                  self.events, drops)
        # a hybrid model's linear-attention state slots: a hit ends where a snapshot is
        self.state = (StatePool(config.num_state_slots, self._chain_value,
                                config.num_host_state_slots if config.host_enabled else 0,
                                config.num_disk_state_slots if config.disk_enabled else 0,
                                config.num_ranks)
                      if config.num_state_slots else None)
        self.moves = TierMoves(config, self.device, self.host, self.disk, self.disk_flow,
                               self.misses, self.stats, self.events, self.state, self._seqs)
        self.admission = Admission(self.moves)

    # --- queries --------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], extra_key: bytes,
               chain: BlockHashChain | None = None) -> PrefixHit:
        """How much of this prompt the cache would serve now. Changes nothing (no stats).

        The hit is capped at (len(token_ids) - 1) // block_size blocks: the last prompt
        token is always computed, for its logits. Pass the sequence's ``chain`` to reuse
        its hashes (hashing is the dominant cost for long prompts)."""
        return self.admission.lookup(token_ids, extra_key, chain)

    def num_cached_tokens(self, seq_id: int) -> PrefixHit:
        """What the first `allocate` of ``seq_id`` took from each tier."""
        return self._seqs[seq_id].hit

    def uncached_tokens(self, seq_id: int) -> UncachedTokens | None:
        """Why the first `allocate` of ``seq_id`` left the rest of its tokens to compute
        (cache/miss_reasons.py); None when it did not count its hit, or without caching."""
        return self._seqs[seq_id].uncached

    def block_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].blocks.tolist()

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def state_slot(self, seq_id: int) -> int:
        """The live state slot of an admitted sequence of a hybrid model; -1 otherwise."""
        return self.state.slot_of(seq_id) if self.state is not None else -1

    def num_allocatable_blocks(self) -> int:
        """Blocks `allocate` could hand out now (free + evictable)."""
        return self.moves.num_allocatable()

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for waiting sequences (`hold`)."""
        return self.admission.num_held_blocks

    # --- per-step mutations -----------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                 extra_key: bytes, chain: BlockHashChain | None = None, *,
                 count_hit: bool = True, budget: int | None = None,
                 previous: PreviousPrompt | None = None) -> list[int] | None:
        """Give ``seq_id`` enough device blocks for its first ``num_tokens`` tokens.

        ``token_ids``: every known token of the sequence (prompt + generated so far).
        The first call takes the prefix hit in full (so the sequence may get more blocks
        than ``num_tokens`` needs; read the hit back with `num_cached_tokens`, which may
        differ from an earlier `lookup` if the cache changed in between). Device hits
        are shared (refcount + 1); host hits get a fresh block and a queued swap_in.
        Returns the block ids appended to the sequence's table, in order (hit blocks
        first), or None when there is not enough room -- and then nothing has changed --
        or when the prefix continues on disk: then this call starts the reads (queued
        disk_read ops, cache/disk_flow.py) and a later call, once every rank has read
        them, takes the hit (the blocks read, as host hits).
        ``count_hit=False``: the first call's hit stays out of the stats (a preempted
        sequence, readmitted, hits the blocks it wrote itself).
        ``budget`` (first call only): at most this many tokens past the hit, i.e. blocks
        for min(num_tokens, hit + budget) tokens -- a step's token budget, applied to the
        hit this call finds, so the caller need not `lookup` the prefix first (a second
        walk of the index for every admission).
        ``previous`` (first call only): the session's latest finished sequence, to tell
        why the tokens past the hit missed (`uncached_tokens`, with count_hit).
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self.admission.allocate_first(seq_id, token_ids, num_tokens, extra_key,
                                                 chain, count_hit, budget, previous)
        if seq.held:
            return self.admission.admit_held(seq_id, token_ids, num_tokens, count_hit,
                                             budget, previous)
        assert budget is None, "a budget applies to a sequence's first allocation"
        assert seq.extra_key == extra_key, "extra_key changed for a live sequence"
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return []
        if need > self.num_allocatable_blocks():
            return None
        blocks = self.moves.take_fresh(need)
        seq.blocks.extend(blocks.tolist())
        return blocks.tolist()

    def hold(self, seq_id: int, token_ids: Sequence[int], extra_key: bytes,
             chain: BlockHashChain | None, *, reserve: int = 0,
             previous: PreviousPrompt | None = None, first: bool = True) -> PrefixHit | None:
        """Take the cached prefix of a sequence that waits in the queue, before it runs:
        its device hits referenced (no longer evictable), its host hits copied into fresh
        device blocks now (queued swap_ins), its disk hits read (as `allocate` starts
        them: None is returned, and a later call takes them). A coding agent's next turn
        waits behind other sessions' prefills; unheld, its history is what their new
        blocks evict, and it then recomputes what it had cached. The sequence's first
        `allocate` later takes the held table as its hit (`Admission.admit_held`). None, and
        nothing changed, when the hold would leave fewer than ``reserve`` blocks
        allocatable, or its disk reads are in flight. Counted in the stats at admission,
        with why the rest missed (asked now, before anything evicts: ``previous`` and
        ``first`` as `allocate`'s ``previous`` and ``count_hit``)."""
        return self.admission.hold(seq_id, token_ids, extra_key, chain, reserve, previous,
                                   first)

    def release_hold(self, seq_id: int) -> None:
        """Let a waiting sequence's held prefix go back to the cache (evictable again)."""
        self.admission.release_hold(seq_id)

    def grow(self, needs: Sequence[tuple[int, int]]) -> list[list[int]] | None:
        """`allocate` for several live sequences at once, all or nothing: ``needs`` are
        (seq_id, num_tokens), each an `allocate` of a sequence that holds blocks already.
        Returns the blocks appended to each table, in order, or None (nothing changed)
        when they do not all fit. The blocks are those the same calls one after the other
        would give (free ones, then evictions, in the same order), with one eviction and
        one write-back for the lot: a decode step grows a few sequences by a block each,
        and numpy's fixed cost per call was most of the work of each."""
        bs = self.block_size
        counts = []
        for seq_id, num_tokens in needs:
            counts.append(max(0, -(-num_tokens // bs) - len(self._seqs[seq_id].blocks)))
        total = sum(counts)
        if total > self.num_allocatable_blocks():
            return None
        fresh = self.moves.take_fresh(total).tolist() if total else []
        out, i = [], 0
        for (seq_id, _), n in zip(needs, counts):
            blocks = fresh[i:i + n]
            i += n
            self._seqs[seq_id].blocks.extend(blocks)
            out.append(blocks)
        return out

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
               step: int, *, closing: bool = False) -> None:
        """Register the full blocks of tokens [0, num_computed_tokens) in the prefix index.

        Call it in the step that writes their KV (once the tokens are scheduled), for
        every scheduled sequence, with the scheduler's step number. Idempotent. A hash
        already indexed to another block keeps that block; this sequence keeps its own
        copy, unindexed. Under write_through, newly registered blocks are copied to the
        host next step.

        ``closing``: the sequence is freed right after, in a later step than ``step``
        (the last that wrote its KV), and these are blocks no plan could register yet
        (scheduler `Scheduler._close`). They stay unevictable until this step's ops
        are drained: ranks apply a step's swap_out before its register (wire/digest.py),
        so an eviction's host copy in the same step would name the block's old hash."""
        self.moves.commit(seq_id, token_ids, num_computed_tokens, step, closing=closing)

    def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]], step: int) -> None:
        """`commit` of several sequences in one step, (seq_id, token_ids,
        num_computed_tokens) each, as the same calls one after the other would do it: the
        blocks they fill are looked up in the index and registered together. A decode
        step fills a block in a few of its sequences, and numpy's fixed cost per call
        was most of each one's registration."""
        self.moves.commit_many(commits, step)

    def trim(self, seq_id: int, num_blocks: int) -> list[int]:
        """Shorten ``seq_id``'s table to ``num_blocks``; returns the blocks dropped, which
        go back to the free list. For blocks appended only for draft tokens the model
        rejected (speculative decoding): they hold no verified token, so they were never
        registered, and nothing else references them. Call it only once the step that
        wrote them has completed (the scheduler does, from that step's results)."""
        seq = self._seqs[seq_id]
        assert seq.num_registered <= num_blocks <= len(seq.blocks), (
            f"seq {seq_id}: trim to {num_blocks} blocks, {seq.num_registered} registered "
            f"of {len(seq.blocks)}")
        dropped = as_array(seq.blocks[num_blocks:])
        if not len(dropped):
            return []
        assert (self.device.refcount[dropped] == 1).all(), "trimming a shared block"
        assert not self.device.index.is_registered(dropped).any(), "trimming a cached block"
        del seq.blocks[num_blocks:]
        self.device.unref(dropped[::-1])
        return dropped.tolist()

    def retain(self, seq_id: int, spans: Sequence[tuple[int, float]]) -> None:
        """Ask for the full blocks of each span's first ``num_tokens`` tokens to stay
        cached, in either tier, ``ttl_s`` after their last use, before any unmarked block
        is kept (a client's `cache_control`; cache/retention.py). Applied when the
        sequence is freed, and refreshed by every later use of the blocks."""
        self._seqs[seq_id].retain = tuple((int(n), float(ttl)) for n, ttl in spans)

    def release_retained(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """The blocks of these hashes (a chain's, head first), in either tier, are
        retained no more: ordinary cached entries, evicted before any retained one (an
        agent's turn that ended without a tool call: a finished sub-agent, a turn that
        waits for its user). Blocks in use lose their mark before their next release."""
        for pool in (self.device, self.host):
            if pool.lru.max_retained == 0:
                continue
            ids = pool.index.find(lo[::-1], hi[::-1])  # tail first: least valuable first
            pool.lru.release(ids[ids >= 0])

    def free(self, seq_id: int, step: int) -> None:
        """Close ``seq_id`` in the scheduler's step ``step``: release its blocks *to the
        cache* (full registered blocks stay hittable in the LRU; the rest return to the
        free list). Never in a step that commits it (the close-timing rule,
        scheduler/scheduler.py `Scheduler._close`); a sequence allocated but not
        committed this step (an admission rolled back) may be freed at once."""
        seq = self._seqs[seq_id]
        assert seq.last_commit_step != step, (
            f"seq {seq_id} closed in step {step}, the step that runs it; "
            "close it with the next step's plan")
        if seq.held:
            self.release_hold(seq_id)
            return
        del self._seqs[seq_id]
        if self.state is not None:
            self.state.close(seq_id)
        blocks = as_array(seq.blocks)
        for num_tokens, ttl_s in seq.retain:
            self.device.lru.mark(blocks[: min(num_tokens // self.block_size,
                                              seq.num_registered)], ttl_s)
        # Tail first: the LRU then evicts a chain's tail before its head, so shared
        # prefixes (system prompt, earlier turns) stay cached longest.
        self.device.unref(blocks[::-1])

    def take_events(self) -> list:
        """Drain the KV events recorded since the last call (none when not recording)."""
        return self.events.take() if self.events is not None else []

    def take_ops(self) -> CacheOps:
        """Drain this step's ops (call exactly once per step, even when empty)."""
        return self.moves.take_ops()

    def peek_ops(self) -> CacheOps:
        """The ops queued so far for this step (a copy; nothing is drained)."""
        return self.moves.peek_ops()

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block, host slot and committed disk slot.
        Returns how many."""
        dropped_device, dropped_host = self.device.drop_cached(), self.host.drop_cached()
        dropped_disk = self.disk.drop_cached()
        if self.state is not None:
            self.state.drop_cached()
        for tier, lo in (("device", dropped_device), ("host", dropped_host),
                         ("disk", dropped_disk)):
            self.misses.dropped(tier, lo, "reset")
        if self.events is not None:
            self.events.device_removed(dropped_device)
            self.events.host_removed(dropped_host)
        return len(dropped_device) + len(dropped_host) + len(dropped_disk)

    def report_disk_writes(self, rank: int, done: list[int], dropped: list[int],
                           read_done: Sequence[int] = (), read_bad: Sequence[int] = ()) -> None:
        """A rank's finished disk writes and reads (its StepResult): a slot is committed,
        and may be read, once every rank wrote it (cache/disk_pool.py); a read is used
        once every rank read it (cache/disk_flow.py)."""
        if done or dropped:
            self.disk.report(rank, done, dropped)
        if read_done or read_bad:
            self.disk_flow.report(rank, list(read_done), list(read_bad))

    def report_state_disk(self, rank: int, done: list[int], dropped: list[int],
                          read_done: list[int], read_bad: list[int]) -> None:
        """A rank's finished state snapshot writes and reads (cache/state_disk.py)."""
        if self.state is not None and self.state.disk is not None:
            self.state.disk.report(rank, done, dropped, read_done, read_bad)

    def cancel_reads(self, seq_id: int) -> None:
        """A sequence that never got its blocks leaves (an abort): its disk reads in
        flight, if any, release their slots once every rank has finished them."""
        self.disk_flow.cancel(seq_id)
        if self.state is not None and self.state.disk is not None:
            self.state.disk.cancel(seq_id)

    def reading(self, seq_id: int) -> bool:
        """Whether ``seq_id`` waits on disk reads it started."""
        return self.disk_flow.is_staged(seq_id) or (
            self.state is not None and self.state.disk is not None
            and self.state.disk.is_staged(seq_id))

    def restore_disk(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Warm restart: disk slots every rank found valid, with their hashes."""
        self.disk.restore(slots, lo, hi)

    def restore_disk_states(self, found: list[tuple[int, int, int]]) -> None:
        """Warm restart: a hybrid model's state records every rank found valid."""
        if self.state is not None and self.state.disk is not None:
            self.state.disk.restore(found)

    def preload(self, tier: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Mark free blocks/slots of ``tier`` ("device" or "host") as cached under these
        hashes. For tools (bench_index) and restores; the KV must really be there."""
        assert tier in ("device", "host"), tier
        pool = self.device if tier == "device" else self.host
        return pool.preload(np.asarray(lo, np.uint64), np.asarray(hi, np.uint64))

    # --- reporting ----------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier, in blocks: used + cached + free == capacity.

        device: used = referenced by a sequence; cached = unreferenced but hashed.
        host: used = pinned by this step's ops, or reserved for a disk read in flight;
        cached = holding a hash; free.
        retained: of the cached (and, on the host, pinned) ones, those kept for a client's
        retention hint (`retain`), evicted only after every other cached one."""
        d, h = self.device, self.host
        return {
            "device": {"capacity": d.num_blocks, "used": d.num_used,
                       "cached": d.num_cached, "free": d.num_free,
                       "retained": d.lru.num_retained,
                       "retained_tokens": d.lru.num_retained * self.block_size},
            "host": {"capacity": h.num_slots, "used": h.num_pinned + h.num_reserved,
                     "cached": h.num_cached, "free": h.num_free,
                     "retained": h.lru.num_retained,
                     "retained_tokens": h.lru.num_retained * self.block_size},
            # disk: used = a write in flight (pending), or a failed read's slot not yet
            # free; cached = committed, readable
            "disk": {"capacity": self.disk.num_slots,
                     "used": self.disk.num_slots - self.disk.num_committed - self.disk.num_free,
                     "cached": self.disk.num_committed, "free": self.disk.num_free,
                     "retained": 0, "retained_tokens": 0},
        }

    def state_usage(self) -> dict[str, dict[str, int]]:
        """A hybrid model's state slots per tier (StatePool.usage); empty for any other."""
        return self.state.usage() if self.state is not None else {}

    def check_accounting(self, live_seq_ids: set[int]) -> None:
        """The cheap check run on every step in production (cache/checks.py). Raises
        CacheAccountingError."""
        problems = checks.accounting_problems(self._seqs, self.device, self.host, live_seq_ids)
        if problems:
            raise CacheAccountingError("; ".join(problems))

    def check_invariants(self) -> None:
        """O(capacity) consistency check, for tests and debug builds (cache/checks.py)."""
        checks.check_invariants(self._seqs, self.device, self.host, self.moves.ops)
        self.disk.check()
        self.disk_flow.check()
        if self.state is not None:
            self.state.check()
        assert all(self.host.reserved[op[2]] for op in self.moves.ops.disk_read)
        assert all(self.host.pinned[op[1]] for op in self.moves.ops.disk_write)

    # --- internals ----------------------------------------------------------------------

    def _chain_value(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """What a state snapshot at each block hash is worth, by that block's KV (int8,
        cache/state_host.py): DEAD where no tier holds it (the snapshot can never be hit),
        RETAINED where a tier retains it, else HELD. cache/state_pool.py evicts the least
        valuable snapshot, so a retained session keeps its snapshots with its KV."""
        value = np.full(len(lo), DEAD, dtype=np.int8)
        for tier in (self.device, self.host, self.disk):
            if tier.lru.num_items == 0:
                continue
            ids = tier.index.find(lo, hi)
            found = np.flatnonzero(ids >= 0)
            value[found] = np.maximum(value[found], HELD)
            value[found[tier.lru.is_retained(ids[found])]] = RETAINED
        return value
