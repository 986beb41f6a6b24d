"""A sequence's first blocks, for cache/manager.py: its prefix hit in each tier (device
hits shared, host hits swapped in, disk hits read first, cache/disk_flow.py; a hybrid
model's hit cut back to its last state snapshot), the cached prefix a waiting sequence
holds before it runs, and the hit counted in the stats with why the rest missed
(cache/miss_reasons.py)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from cache.hashing import BlockHashChain
from cache.matching import Match, match_prefix, truncated
from cache.miss_reasons import PreviousPrompt
from cache.tier_moves import TierMoves
from cache.types import PrefixHit, SeqEntry, as_array
from wire.client import UncachedTokens


class Admission:
    """Prefix hits and holds, over the manager's sequences and tiers: those its ``moves``
    work on (the fresh blocks and swap_ins of an admission are queued there)."""

    def __init__(self, moves: TierMoves) -> None:
        self.moves = moves
        self.config, self.block_size, self.seqs = moves.config, moves.block_size, moves.seqs
        self.device, self.host, self.disk = moves.device, moves.host, moves.disk
        self.disk_flow, self.misses, self.stats = moves.disk_flow, moves.misses, moves.stats
        self.events, self.state = moves.events, moves.state
        self.num_held_blocks = 0  # blocks held for waiting sequences (`hold`)

    def lookup(self, token_ids: Sequence[int], extra_key: bytes,
               chain: BlockHashChain | None) -> PrefixHit:
        """`KVCacheManager.lookup`."""
        if not self.config.enable_prefix_caching:
            return PrefixHit(0, 0)
        chain = self.chain_for(extra_key, chain)
        m = match_prefix(self.device, self.host, self.disk, token_ids, chain)
        if self.state is not None:
            m = truncated(m, self.state.best(chain, m.num_blocks)[0])
        return self.hit_of(m)

    def hold(self, seq_id: int, token_ids: Sequence[int], extra_key: bytes,
             chain: BlockHashChain | None, reserve: int,
             previous: PreviousPrompt | None, first: bool) -> PrefixHit | None:
        """`KVCacheManager.hold`."""
        assert seq_id not in self.seqs, f"seq {seq_id} already holds blocks"
        if not self.config.enable_prefix_caching:
            return None
        table = self.allocate_first(seq_id, token_ids, len(token_ids), extra_key, chain,
                                    count_hit=False, budget=0, previous=previous,
                                    reserve=reserve, attribute=first, opening=False)
        if table is None:
            return None
        seq = self.seqs[seq_id]
        seq.held = True
        self.num_held_blocks += len(seq.blocks)
        return seq.hit

    def admit_held(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                   count_hit: bool, budget: int | None,
                   previous: PreviousPrompt | None) -> list[int] | None:
        """The first `allocate` of a sequence that held its prefix while it waited: the
        held table is its hit, and fresh blocks follow for ``num_tokens`` (capped at
        ``budget`` past the hit). If more of the prompt is cached now than when it was
        held (another request registered it meanwhile), the hold is let go and the
        prefix taken afresh."""
        seq = self.seqs[seq_id]
        n_held = len(seq.blocks)
        m = match_prefix(self.device, self.host, self.disk, token_ids, seq.chain)
        if self.state is not None:
            m = truncated(m, self.state.best(seq.chain, m.num_blocks)[0])
        if m.num_blocks > n_held:
            self.release_hold(seq_id)
            return self.allocate_first(seq_id, token_ids, num_tokens, seq.extra_key,
                                       seq.chain, count_hit, budget, previous)
        if budget is not None:
            num_tokens = min(num_tokens, n_held * self.block_size + budget)
        need = max(0, -(-num_tokens // self.block_size) - n_held)
        if need > self.moves.num_allocatable():
            return None
        if self.state is not None:
            if not self.state.can_open():
                return None
            self.state.open(seq_id, seq.restore)
            seq.restore = -1
        seq.blocks.extend(self.moves.take_fresh(need, "admission").tolist())
        seq.held = False
        self.num_held_blocks -= n_held
        if count_hit:
            self.count_hit(len(token_ids), seq.hit, seq.uncached)
        return seq.blocks.tolist()

    def release_hold(self, seq_id: int) -> None:
        """Let a waiting sequence's held prefix go back to the cache (evictable again)."""
        seq = self.seqs.pop(seq_id)
        assert seq.held, f"seq {seq_id} holds no prefix"
        if seq.restore >= 0:
            self.state.unpin(seq.restore)
        self.num_held_blocks -= len(seq.blocks)
        self.device.unref(as_array(seq.blocks)[::-1])

    def allocate_first(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                       extra_key: bytes, chain: BlockHashChain | None,
                       count_hit: bool, budget: int | None = None,
                       previous: PreviousPrompt | None = None, reserve: int = 0,
                       attribute: bool | None = None, opening: bool = True,
                       ) -> list[int] | None:
        """The first `allocate` of ``seq_id`` (`KVCacheManager.allocate`); `hold` takes
        its prefix with ``reserve``, ``attribute`` and ``opening``."""
        if self.config.enable_prefix_caching:
            chain = self.chain_for(extra_key, chain)
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
                                     self.moves.ops.disk_read)
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
        if n_fresh > self.moves.num_allocatable() - hit_evictable - reserve:
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
        fresh = self.moves.take_fresh(n_fresh, "admission")
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
            self.moves.ops.swap_in.extend(zip(host_hits.tolist(), loaded.tolist()))
            self.stats.num_swap_in_blocks += len(loaded)

        hit = self.hit_of(m, read_back)
        self.seqs[seq_id] = SeqEntry(extra_key, chain, array("i", table.tobytes()), hit,
                                     n_hit, uncached=uncached)
        if self.state is not None and opening:
            self.state.open(seq_id, restore)
        else:
            self.seqs[seq_id].restore = restore
        if count_hit:
            self.count_hit(len(token_ids), hit, uncached)
        return table.tolist()

    def hit_of(self, m: Match, read_back: np.ndarray | None = None) -> PrefixHit:
        """Tokens per tier; a host hit on a slot in ``read_back`` (just read from disk
        for this sequence) counts as a disk hit."""
        n_dev = int((m.device >= 0).sum())
        n_disk = int((m.disk >= 0).sum())
        if read_back is not None and len(read_back):
            n_disk += int(np.isin(m.host[m.device < 0], read_back).sum())
        bs = self.block_size
        return PrefixHit(n_dev * bs, (m.num_blocks - n_dev - n_disk) * bs, n_disk * bs)

    def count_hit(self, num_queried: int, hit: PrefixHit,
                  uncached: UncachedTokens | None) -> None:
        self.stats.num_queried_tokens += num_queried
        self.stats.num_device_hit_tokens += hit.num_device_tokens
        self.stats.num_host_hit_tokens += hit.num_host_tokens
        self.stats.num_disk_hit_tokens += hit.num_disk_tokens
        if uncached is not None:
            self.misses.count(self.stats, uncached)

    def chain_for(self, extra_key: bytes, chain: BlockHashChain | None) -> BlockHashChain:
        if chain is None:
            return BlockHashChain(self.block_size, extra_key)
        assert chain.extra_key == extra_key and chain.block_size == self.block_size
        return chain
