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
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cache import checks
from cache.block_pool import DevicePool
from cache.disk_flow import DiskFlow
from cache.disk_pool import DiskPool
from cache.events import KVEventRecorder
from cache.eviction_memory import EvictionMemory
from cache.hashing import BlockHashChain
from cache.host_pool import HostPool
from cache.matching import Match, match_prefix, truncated
from cache.miss_reasons import MissAttribution, PreviousPrompt
from cache.retention import RetentionPolicy
from cache.state_host import DEAD, HELD, RETAINED
from cache.state_pool import StatePool
from cache.stats import CacheStats
from cache.types import WRITE_POLICIES, CacheAccountingError, CacheConfig, CacheOps, PrefixHit
from wire.client import UncachedTokens

__all__ = ["WRITE_POLICIES", "CacheAccountingError", "CacheConfig", "CacheOps",
           "KVCacheManager", "PrefixHit"]

@dataclass
class _Seq:
    extra_key: bytes
    chain: BlockHashChain | None  # None when prefix caching is off
    blocks: array  # int32 block table
    hit: PrefixHit
    num_registered: int  # leading blocks already through `commit` (hits included)
    last_commit_step: int = -1
    retain: tuple[tuple[int, float], ...] = ()  # (prompt tokens, TTL s): marked at free
    held: bool = False  # its table is the cached prefix of a waiting sequence (`hold`)
    uncached: UncachedTokens | None = None  # why its first allocate missed the rest
    restore: int = -1  # held: the state snapshot its hit ends at (pinned), a hybrid model's


def _as_array(blocks: array) -> np.ndarray:
    # A copy, never a view: a view would pin the array and make a later extend() raise.
    return np.frombuffer(blocks.tobytes(), dtype=np.int32)


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
        self._seqs: dict[int, _Seq] = {}
        self._ops = CacheOps()
        # Blocks committed this step under write_through: their KV is written by this
        # step's forward pass, so their copy to the host goes into the *next* step's ops.
        self._write_through_next: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.events = (KVEventRecorder(config.num_device_blocks, config.block_size)
                       if config.record_events and config.enable_prefix_caching else None)
        self.disk_flow = DiskFlow(self.host, self.disk, config.num_ranks, self.stats,
                                  self.events, drops)
        self.num_held_blocks = 0  # blocks held for waiting sequences (`hold`)
        # a hybrid model's linear-attention state slots: a hit ends where a snapshot is
        self.state = (StatePool(config.num_state_slots, self._chain_value,
                                config.num_host_state_slots if config.host_enabled else 0,
                                config.num_disk_state_slots if config.disk_enabled else 0,
                                config.num_ranks)
                      if config.num_state_slots else None)

    # --- queries --------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], extra_key: bytes,
               chain: BlockHashChain | None = None) -> PrefixHit:
        """How much of this prompt the cache would serve now. Changes nothing (no stats).

        The hit is capped at (len(token_ids) - 1) // block_size blocks: the last prompt
        token is always computed, for its logits. Pass the sequence's ``chain`` to reuse
        its hashes (hashing is the dominant cost for long prompts)."""
        if not self.config.enable_prefix_caching:
            return PrefixHit(0, 0)
        chain = self._chain_for(extra_key, chain)
        m = match_prefix(self.device, self.host, self.disk, token_ids, chain)
        if self.state is not None:
            m = truncated(m, self.state.best(chain, m.num_blocks)[0])
        return self._hit_of(m)

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
        return self.device.num_free + self.device.num_evictable()

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
            return self._allocate_first(seq_id, token_ids, num_tokens, extra_key, chain,
                                        count_hit, budget, previous)
        if seq.held:
            return self._admit_held(seq_id, token_ids, num_tokens, count_hit, budget,
                                    previous)
        assert budget is None, "a budget applies to a sequence's first allocation"
        assert seq.extra_key == extra_key, "extra_key changed for a live sequence"
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return []
        if need > self.num_allocatable_blocks():
            return None
        blocks = self._take_fresh(need)
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
        `allocate` later takes the held table as its hit (`_admit_held`). None, and
        nothing changed, when the hold would leave fewer than ``reserve`` blocks
        allocatable, or its disk reads are in flight. Counted in the stats at admission,
        with why the rest missed (asked now, before anything evicts: ``previous`` and
        ``first`` as `allocate`'s ``previous`` and ``count_hit``)."""
        assert seq_id not in self._seqs, f"seq {seq_id} already holds blocks"
        if not self.config.enable_prefix_caching:
            return None
        table = self._allocate_first(seq_id, token_ids, len(token_ids), extra_key, chain,
                                     count_hit=False, budget=0, previous=previous,
                                     reserve=reserve, attribute=first, opening=False)
        if table is None:
            return None
        seq = self._seqs[seq_id]
        seq.held = True
        self.num_held_blocks += len(seq.blocks)
        return seq.hit

    def _admit_held(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                    count_hit: bool, budget: int | None,
                    previous: PreviousPrompt | None) -> list[int] | None:
        """The first `allocate` of a sequence that held its prefix while it waited: the
        held table is its hit, and fresh blocks follow for ``num_tokens`` (capped at
        ``budget`` past the hit). If more of the prompt is cached now than when it was
        held (another request registered it meanwhile), the hold is let go and the
        prefix taken afresh."""
        seq = self._seqs[seq_id]
        n_held = len(seq.blocks)
        m = match_prefix(self.device, self.host, self.disk, token_ids, seq.chain)
        if self.state is not None:
            m = truncated(m, self.state.best(seq.chain, m.num_blocks)[0])
        if m.num_blocks > n_held:
            self.release_hold(seq_id)
            return self._allocate_first(seq_id, token_ids, num_tokens, seq.extra_key,
                                        seq.chain, count_hit, budget, previous)
        if budget is not None:
            num_tokens = min(num_tokens, n_held * self.block_size + budget)
        need = max(0, -(-num_tokens // self.block_size) - n_held)
        if need > self.num_allocatable_blocks():
            return None
        if self.state is not None:
            if not self.state.can_open():
                return None
            self.state.open(seq_id, seq.restore)
            seq.restore = -1
        seq.blocks.extend(self._take_fresh(need, "admission").tolist())
        seq.held = False
        self.num_held_blocks -= n_held
        if count_hit:
            self._count_hit(len(token_ids), seq.hit, seq.uncached)
        return seq.blocks.tolist()

    def release_hold(self, seq_id: int) -> None:
        """Let a waiting sequence's held prefix go back to the cache (evictable again)."""
        seq = self._seqs.pop(seq_id)
        assert seq.held, f"seq {seq_id} holds no prefix"
        if seq.restore >= 0:
            self.state.unpin(seq.restore)
        self.num_held_blocks -= len(seq.blocks)
        self.device.unref(_as_array(seq.blocks)[::-1])

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
        fresh = self._take_fresh(total).tolist() if total else []
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
        seq = self._seqs[seq_id]
        seq.last_commit_step = step
        if seq.chain is None:
            return
        n_full = num_computed_tokens // self.block_size
        assert num_computed_tokens <= len(token_ids), "committing tokens that are not known"
        assert n_full <= len(seq.blocks), "committing tokens beyond the allocated blocks"
        start = seq.num_registered
        if n_full <= start:
            if self.state is not None:  # snapshots taken at blocks registered already
                self.state.commit(seq_id, seq.chain, start)
            return
        num_hashed = seq.chain.extend(token_ids, n_full)
        assert num_hashed >= n_full
        lo, hi = seq.chain.keys(start, n_full)
        blocks = _as_array(seq.blocks[start:n_full])
        new = self.device.index.find(lo, hi) < 0
        if self.events is not None and new.any():
            parent_lo = seq.chain.keys(start - 1, start)[0] if start else lo[:0]
            self.events.device_stored(blocks[new], start + np.flatnonzero(new),
                                      np.concatenate([parent_lo, lo]), start - len(parent_lo),
                                      token_ids)
        seq.num_registered = n_full
        self._register(blocks[new], lo[new], hi[new], closing)
        if self.state is not None:
            self.state.commit(seq_id, seq.chain, n_full)

    def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]], step: int) -> None:
        """`commit` of several sequences in one step, (seq_id, token_ids,
        num_computed_tokens) each, as the same calls one after the other would do it: the
        blocks they fill are looked up in the index and registered together. A decode
        step fills a block in a few of its sequences, and numpy's fixed cost per call
        was most of each one's registration."""
        if self.events is not None:  # events name each sequence's parent hashes
            for seq_id, token_ids, num_computed in commits:
                self.commit(seq_id, token_ids, num_computed, step)
            return
        bs = self.block_size
        keys: list[tuple[np.ndarray, np.ndarray]] = []
        tables: list[array] = []
        for seq_id, token_ids, num_computed in commits:
            seq = self._seqs[seq_id]
            seq.last_commit_step = step
            n_full = num_computed // bs
            start = seq.num_registered
            if seq.chain is None or n_full <= start:
                if seq.chain is not None and self.state is not None:
                    self.state.commit(seq_id, seq.chain, start)
                continue
            assert num_computed <= len(token_ids), "committing tokens that are not known"
            assert n_full <= len(seq.blocks), "committing tokens beyond the allocated blocks"
            num_hashed = seq.chain.extend(token_ids, n_full)
            assert num_hashed >= n_full
            keys.append(seq.chain.keys(start, n_full))
            tables.append(seq.blocks[start:n_full])
            seq.num_registered = n_full
            if self.state is not None:
                self.state.commit(seq_id, seq.chain, n_full)
        if not keys:
            return
        lo = np.concatenate([k[0] for k in keys])
        hi = np.concatenate([k[1] for k in keys])
        blocks = np.frombuffer(b"".join(t.tobytes() for t in tables), dtype=np.int32)
        new = self.device.index.find(lo, hi) < 0
        # Two sequences may fill blocks of the same hash in one step (the same prompt
        # and tokens): as one after the other, the first registers it, the second keeps
        # its copy unindexed.
        pairs = list(zip(lo.tolist(), hi.tolist()))
        if len(set(pairs)) < len(pairs):
            seen: set[tuple[int, int]] = set()
            for i, key in enumerate(pairs):
                if new[i]:
                    new[i] = key not in seen
                    seen.add(key)
        self._register(blocks[new], lo[new], hi[new], closing=False)

    def _register(self, blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                  closing: bool) -> None:
        """Index referenced blocks newly filled (`commit`), and queue them for the ranks."""
        self.device.register(blocks, lo, hi)
        if closing:  # hittable at once, but not evictable before this step's ops drain
            self.device.mark_busy(blocks)
        self._ops.registered.extend(zip(blocks.tolist(), lo.tolist()))
        if self.config.write_policy == "write_through" and self.config.host_enabled:
            self._write_through_next.append((blocks, lo, hi))

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
        dropped = _as_array(seq.blocks[num_blocks:])
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
        blocks = _as_array(seq.blocks)
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
        ops, self._ops = self._ops, CacheOps()
        if self.state is not None:
            ops.state_copy, ops.state_register = self.state.take_ops()
            ops.state_swap_out, ops.state_swap_in = self.state.take_swaps()
            if self.state.disk is not None:
                ops.state_disk_write, ops.state_disk_read = self.state.disk.take_ops()
        self.device.clear_busy()
        self.host.unpin_all()
        self.disk.unpin_all()
        pending, self._write_through_next = self._write_through_next, []
        for blocks, lo, hi in pending:
            # Still indexed, and referenced unless their sequence was closed as they were
            # registered (`commit(closing=True)`: busy, so not evicted in that step).
            assert (self.device.index.keys_of(blocks)[0] == lo).all()
            self._copy_to_host(blocks[::-1], lo[::-1], hi[::-1])  # tail first
        return ops

    def peek_ops(self) -> CacheOps:
        """The ops queued so far for this step (a copy; nothing is drained)."""
        ops = CacheOps(list(self._ops.swap_out), list(self._ops.swap_in),
                       list(self._ops.registered), list(self._ops.disk_write),
                       list(self._ops.disk_read))
        if self.state is not None:
            ops.state_copy, ops.state_register = self.state.peek_ops()
            ops.state_swap_out, ops.state_swap_in = self.state.peek_swaps()
            if self.state.disk is not None:
                ops.state_disk_write = list(self.state.disk.write_ops)
                ops.state_disk_read = list(self.state.disk.read_ops)
        return ops

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
        checks.check_invariants(self._seqs, self.device, self.host, self._ops)
        self.disk.check()
        self.disk_flow.check()
        if self.state is not None:
            self.state.check()
        assert all(self.host.reserved[op[2]] for op in self._ops.disk_read)
        assert all(self.host.pinned[op[1]] for op in self._ops.disk_write)

    # --- internals ----------------------------------------------------------------------

    def _chain_for(self, extra_key: bytes, chain: BlockHashChain | None) -> BlockHashChain:
        if chain is None:
            return BlockHashChain(self.block_size, extra_key)
        assert chain.extra_key == extra_key and chain.block_size == self.block_size
        return chain

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

    def _hit_of(self, m: Match, read_back: np.ndarray | None = None) -> PrefixHit:
        """Tokens per tier; a host hit on a slot in ``read_back`` (just read from disk
        for this sequence) counts as a disk hit."""
        n_dev = int((m.device >= 0).sum())
        n_disk = int((m.disk >= 0).sum())
        if read_back is not None and len(read_back):
            n_disk += int(np.isin(m.host[m.device < 0], read_back).sum())
        bs = self.block_size
        return PrefixHit(n_dev * bs, (m.num_blocks - n_dev - n_disk) * bs, n_disk * bs)

    def _allocate_first(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                        extra_key: bytes, chain: BlockHashChain | None,
                        count_hit: bool, budget: int | None = None,
                        previous: PreviousPrompt | None = None, reserve: int = 0,
                        attribute: bool | None = None, opening: bool = True,
                        ) -> list[int] | None:
        if self.config.enable_prefix_caching:
            chain = self._chain_for(extra_key, chain)
            state_disk = self.state.disk if self.state is not None else None
            settled = self.disk_flow.settle(seq_id)
            if state_disk is not None:
                settled = state_disk.settle(seq_id) and settled
            if not settled:
                return None  # its disk reads are still in flight on some rank
            m = match_prefix(self.device, self.host, self.disk, token_ids, chain)
            n_matched = m.num_blocks  # before a hybrid model's cut to its last state
            restore = -1
            if self.state is not None:
                n_state, restore = self.state.best(chain, m.num_blocks)
                if self.state.written_this_plan(chain, n_state, m.num_blocks):
                    return None  # a longer hit is restorable from the next plan on
                # a later snapshot on disk: read it into the host (a later call restores
                # it from there), the KV hit reaching as far
                n_disk, disk_slot, key = self.state.on_disk(chain, m.num_blocks, n_state)
                if n_disk and state_disk.stage(seq_id, disk_slot, key):
                    n_state = n_disk
                m = truncated(m, n_state)
            on_disk = np.flatnonzero(m.disk >= 0)
            if len(on_disk):  # start the reads; a later call takes the hit
                lo, hi = chain.keys(0, m.num_blocks)
                self.disk_flow.stage(seq_id, m.disk[on_disk], lo[on_disk], hi[on_disk],
                                     self._ops.disk_read)
            if len(on_disk) or (state_disk is not None and state_disk.is_staged(seq_id)):
                return None
        else:
            chain = None
            m = Match(0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
            n_matched, restore = 0, -1
        n_hit = m.num_blocks
        if budget is not None:
            num_tokens = min(num_tokens, n_hit * self.block_size + budget)
        on_host = m.device < 0
        dev_hits = m.device[~on_host]
        host_hits = m.host[on_host]
        n_total = max(n_hit, -(-num_tokens // self.block_size))
        n_fresh = n_total - n_hit + len(host_hits)
        # Hits on cached blocks take them out of the evictable set (busy ones never were).
        lru = self.device.lru
        hit_evictable = int((lru.present[dev_hits] & ~self.device.busy[dev_hits]).sum())
        if n_fresh > self.num_allocatable_blocks() - hit_evictable - reserve:
            return None  # nothing changed yet
        if restore >= 0:
            self.state.pin(restore)  # held until its copy is planned (`StatePool.open`)
        if opening and self.state is not None and not self.state.can_open():
            if restore >= 0:
                self.state.unpin(restore)
            return None  # no state slot for it to run in: nothing changed
        # why the rest missed, asked before this allocation evicts anything
        if attribute is None:
            attribute = count_hit
        uncached = None
        if attribute and chain is not None:
            uncached = self.misses.attribute(token_ids, chain, n_matched, previous)
            uncached.no_state = (n_matched - n_hit) * self.block_size

        # Order matters: take the hits (and pin the host sources) before evicting for
        # fresh blocks, so the eviction cannot reclaim the prefix being hit.
        self.device.ref(dev_hits)
        self.host.lru.touch(host_hits)  # a use: a retained slot's TTL runs from now
        self.host.pin(host_hits[::-1])  # touched tail first: the chain's head stays longest
        read_back = self.disk_flow.take_read_back(seq_id)
        fresh = self._take_fresh(n_fresh, "admission")
        loaded = fresh[:len(host_hits)]
        table = np.empty(n_total, dtype=np.int32)
        if len(loaded):
            hits = table[:n_hit]  # a view
            hits[~on_host] = dev_hits
            hits[on_host] = loaded
        else:  # most admissions: the hit (if any) is on the device alone
            table[:n_hit] = m.device
        table[n_hit:] = fresh[len(host_hits):]
        if len(loaded):
            lo, hi = chain.keys(0, n_hit)
            self.device.register(loaded, lo[on_host], hi[on_host])
            if self.events is not None:
                self.events.device_stored(loaded, np.flatnonzero(on_host), lo, 0, token_ids)
                # the disk hits' host slots hold them too now (their tokens: just recorded)
                from_disk = np.flatnonzero(on_host & np.isin(m.host, read_back))
                self.events.host_stored(table[from_disk], lo[from_disk])
            self.device.lru.copy_retention(loaded, self.host.lru, host_hits)
            self.device.mark_busy(loaded)
            self._ops.swap_in.extend(zip(host_hits.tolist(), loaded.tolist()))
            self.stats.num_swap_in_blocks += len(loaded)

        hit = self._hit_of(m, read_back)
        self._seqs[seq_id] = _Seq(extra_key, chain, array("i", table.tobytes()), hit, n_hit,
                                  uncached=uncached)
        if self.state is not None and opening:
            self.state.open(seq_id, restore)
        else:
            self._seqs[seq_id].restore = restore
        if count_hit:
            self._count_hit(len(token_ids), hit, uncached)
        return table.tolist()

    def _count_hit(self, num_queried: int, hit: PrefixHit,
                   uncached: UncachedTokens | None) -> None:
        self.stats.num_queried_tokens += num_queried
        self.stats.num_device_hit_tokens += hit.num_device_tokens
        self.stats.num_host_hit_tokens += hit.num_host_tokens
        self.stats.num_disk_hit_tokens += hit.num_disk_tokens
        if uncached is not None:
            self.misses.count(self.stats, uncached)

    def _take_fresh(self, k: int, cause: str = "growth") -> np.ndarray:
        """``k`` blocks with refcount 1, evicting (and writing back) cached ones if needed.
        ``cause``: what they are for, `admission` or `growth` (cache/eviction_memory.py)."""
        # An evicted block may become, this very step, a swap_in target or get new KV:
        # safe only because workers apply its swap_out (queued below) before both.
        blocks, evicted, lo, hi = self.device.take(k)
        self.misses.dropped("device", lo, cause)
        if self.events is not None:
            self.events.device_removed(lo)
        self.stats.num_device_evictions += len(evicted)
        self.stats.num_device_retained_evictions = self.device.lru.early_evictions
        if (len(evicted) and self.config.write_policy == "write_back"
                and self.config.host_enabled):
            self._copy_to_host(evicted, lo, hi)  # with their retention, if any
        self.device.lru.clear(evicted)
        return blocks

    def _copy_to_host(self, blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Queue swap_out of device blocks whose hashes the host does not hold yet.

        ``blocks`` come least valuable first (LRU order: a freed chain's tail before its
        head). Best effort: when every other host slot is pinned this step, the least
        valuable ones are dropped -- a chain without its head would be useless."""
        assert not self.device.busy[blocks].any(), "copying a block whose KV is not loaded"
        miss = self.host.find(lo, hi) < 0
        blocks, lo, hi = blocks[miss], lo[miss], hi[miss]
        slots, evicted, evicted_lo = self.host.take(len(blocks))
        self.misses.dropped("host", evicted_lo, self.config.write_policy)
        if self.events is not None:
            self.events.host_removed(evicted_lo)
        self.stats.num_host_evictions += len(evicted)
        self.stats.num_host_retained_evictions = self.host.lru.early_evictions
        n = len(slots)
        blocks, lo, hi = blocks[len(blocks) - n:], lo[len(lo) - n:], hi[len(hi) - n:]
        self.host.lru.copy_retention(slots, self.device.lru, blocks)
        self.host.register(slots, lo, hi)
        if self.events is not None:
            self.events.host_stored(blocks, lo)
        self._ops.swap_out.extend(zip(blocks.tolist(), slots.tolist()))
        self.stats.num_swap_out_blocks += n
        if self.disk.num_slots and n:  # write-through to disk, in the background
            self.disk_flow.write_through(slots, lo, hi, self._ops.disk_write)
