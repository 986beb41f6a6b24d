"""A reason for every prompt token the cache did not serve, so an operator can tell why
tokens were computed again (wire/client.py UncachedTokens; the vocabulary and the order
that picks a request's main reason are UNCACHED_REASONS there).

Found once per sequence, at its first admission (the prompt as first received; a
preempted sequence's readmission is not a new miss), by the manager's first `allocate`,
after the prefix match and before any eviction it makes (which could drop the very blocks
it is asked about). The prompt's L tokens split into the hit (H full blocks), the blocks
[H, cap) no hit reached (cap = (L - 1) // block_size: a hit leaves the last token to be
computed) and the rest, `block_remainder`. Each block of [H, cap) gets one reason:

1. The blocks the cache knew: from H to the last block that is either still cached
   somewhere (past the break, unreachable because the chain broke before it) or
   remembered as dropped (cache/eviction_memory.py). A block's hash chains over every
   block before it, so each block before a known one was cached once too, even where
   the memory forgot its drop. From the first of them no tier holds any more, all are
   `evicted` (the ones still cached past it were lost with it; the first drop the memory
   has gives the tier, age and cause); one still cached at the break itself can only be
   a disk hit with no host slot to land in (cache/matching.py), `no_room`. The walk
   hashes and looks up the blocks in chunks, and stops after a chunk with no known block
   in it, so a prompt never sent costs one chunk, not the prompt.
2. The blocks after that, by the session's previous sequence (its prompt and output,
   scheduler/session_chains.py), if any:
   - same cache key: with N the tokens both share, a block past N that the previous one
     covered was edited, `diverged` -- or `compaction` when the previous one was at least
     COMPACTION_RATIO times as long as this prompt (a history replaced by a summary);
     a block before N (the previous one never got it cached) or past its end is `new`;
   - another cache key (salt, tenant): a block whose tokens the previous one shared, and
     that is still cached under the previous key, is `salt`; the others are `new`.
   Without a previous sequence every one is `new`. Only what the scheduler remembers of
   the session is known: another session's blocks under another salt are not looked for,
   and a subagent's first prompt, which shares only the system prompt with its main
   agent's long history, reads as a compaction.

N is found without reading the prompt twice: the two chains' hashes tell the common full
blocks (a binary search: equal hashes at block i mean equal tokens up to it), and only the
tokens after them are compared, in growing chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cache.block_pool import DevicePool
from cache.disk_pool import DiskPool
from cache.eviction_memory import EvictionMemory
from cache.hashing import BlockHashChain
from cache.host_pool import HostPool
from cache.stats import CacheStats
from wire.client import UncachedTokens

COMPACTION_RATIO = 2  # the previous sequence at least this many times the prompt's length


@dataclass
class PreviousPrompt:
    """A session's latest finished sequence, as the scheduler remembers it."""

    tokens: np.ndarray  # int64: its prompt and output
    chain: BlockHashChain  # their block hashes, under the key it was sent with


class MissAttribution:
    def __init__(self, device: DevicePool, host: HostPool, disk: DiskPool,
                 memory: EvictionMemory, block_size: int,
                 clock: Callable[[], float]) -> None:
        self.device, self.host, self.disk = device, host, disk
        self.memory = memory
        self.block_size = block_size
        self._clock = clock

    def dropped(self, tier: str, lo: np.ndarray, cause: str) -> None:
        """``tier`` let go of these hashes (low words); see cache/eviction_memory.py."""
        self.memory.add(tier, lo, cause)

    def attribute(self, token_ids: Sequence[int], chain: BlockHashChain, num_hit_blocks: int,
                  previous: PreviousPrompt | None) -> UncachedTokens:
        """Why each token past the first ``num_hit_blocks`` blocks is computed (see the
        module docstring). Reads the tiers as they are now: call it before the
        allocation that follows the match evicts anything."""
        bs = self.block_size
        cap = max(len(token_ids) - 1, 0) // bs
        hit = num_hit_blocks
        out = UncachedTokens(block_remainder=len(token_ids) - cap * bs)
        known, first_gone, entry = self._known_run(token_ids, chain, hit, cap)
        out.no_room = (min(first_gone, known) - hit) * bs
        out.evicted = max(0, known - first_gone) * bs
        if out.evicted and entry >= 0:  # else the memory forgot every one of them
            drop = self.memory.drop(entry)
            out.evicted_tier, out.evicted_by = drop.tier, drop.cause
            out.evicted_age_s = round(max(0.0, self._clock() - drop.time), 3)
        if known < cap:
            self._unknown(out, token_ids, chain, known, cap, previous)
        assert out.num_tokens == len(token_ids) - hit * bs, (out, len(token_ids), hit)
        return out

    def count(self, stats: CacheStats, uncached: UncachedTokens) -> None:
        for reason, n in uncached.by_reason().items():
            name = f"num_uncached_{reason}_tokens"
            setattr(stats, name, getattr(stats, name) + n)

    # --- 1. the blocks the cache knows ------------------------------------------------

    def _known_run(self, token_ids: Sequence[int], chain: BlockHashChain, start: int,
                   cap: int) -> tuple[int, int, int]:
        """(the end of the blocks the cache knew: past the last one from ``start`` that is
        cached or remembered as dropped; the first one no tier holds; the memory entry of
        the first remembered drop, or -1). Hashes in chunks growing 8x, as
        cache/matching.py does, until a chunk holds no known block."""
        end, first_gone, entry = start, cap, -1
        n = start
        chunk = max(chain.num_blocks - start, 16)  # what the match hashed already, first
        while n < cap:
            upto = min(cap, n + chunk)
            assert chain.extend(token_ids, upto) >= upto
            lo, hi = chain.keys(n, upto)
            cached = self._cached(lo, hi)
            entries = self.memory.find(lo)
            known = np.flatnonzero(cached | (entries >= 0))
            if len(known) == 0:
                break
            end = n + int(known[-1]) + 1
            if first_gone == cap and not cached.all():
                first_gone = n + int(np.argmin(cached))
            if entry < 0:
                dropped = np.flatnonzero(~cached & (entries >= 0))
                entry = int(entries[dropped[0]]) if len(dropped) else -1
            n, chunk = upto, chunk * 8
        return end, first_gone, entry

    def _cached(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Whether each hash is findable in some tier now (as cache/matching.py finds)."""
        cached = self.device.index.find(lo, hi) >= 0
        if self.host.num_slots:
            cached |= self.host.find(lo, hi) >= 0
        if self.disk.num_slots:
            cached |= self.disk.find(lo, hi) >= 0
        return cached

    # --- 2. the blocks it never knew --------------------------------------------------

    def _unknown(self, out: UncachedTokens, token_ids: Sequence[int], chain: BlockHashChain,
                 start: int, cap: int, previous: PreviousPrompt | None) -> None:
        """Blocks [start, cap), none of which the cache knew: by the session's previous
        sequence, else new."""
        bs = self.block_size
        num_blocks = cap - start
        if previous is None:
            out.new += num_blocks * bs
            return
        prev_len = len(previous.tokens)
        if previous.chain.extra_key != chain.extra_key:
            out.salt = self._salted(token_ids, previous, start, cap) * bs
            out.new += num_blocks * bs - out.salt
            return
        if start * bs >= prev_len:  # all past the previous sequence: a new turn
            out.new += num_blocks * bs
            return
        common = _common_tokens(previous, token_ids, chain)
        if common >= min(prev_len, len(token_ids)):  # extends it, or is a prefix of it
            out.new += num_blocks * bs
            return
        # blocks past the common tokens that the previous sequence covered (i*bs < prev_len)
        edited = max(0, min(cap, -(-prev_len // bs)) - max(start, common // bs))
        reason = ("compaction" if prev_len >= COMPACTION_RATIO * len(token_ids)
                  else "diverged")
        if edited:
            setattr(out, reason, edited * bs)
            out.diverged_at = common
        out.new += (num_blocks - edited) * bs

    def _salted(self, token_ids: Sequence[int], previous: PreviousPrompt, start: int,
                cap: int) -> int:
        """Of blocks [start, cap), how many the previous sequence (another cache key) had
        with the same tokens and still has cached under its key."""
        common = _first_difference(previous.tokens, token_ids, 0,
                                   min(len(previous.tokens), len(token_ids)))
        stop = min(cap, common // self.block_size, previous.chain.num_blocks)
        if stop <= start:
            return 0
        lo, hi = previous.chain.keys(start, stop)
        return int(self._cached(lo, hi).sum())


def _common_tokens(previous: PreviousPrompt, token_ids: Sequence[int],
                   chain: BlockHashChain) -> int:
    """How many leading tokens the prompt shares with the previous sequence (same key):
    the full blocks whose hashes agree, then a token compare from there."""
    bs = chain.block_size
    a, b = previous.chain, chain
    lo, hi = 0, min(a.num_blocks, b.num_blocks)  # equal hashes up to lo, unknown past
    while lo < hi:  # prefix-closed: equal at i means equal at every block before
        mid = (lo + hi + 1) // 2
        if a.digest(mid - 1) == b.digest(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    stop = min(len(previous.tokens), len(token_ids))
    return _first_difference(previous.tokens, token_ids, min(lo * bs, stop), stop)


def _first_difference(known: np.ndarray, token_ids: Sequence[int], start: int,
                      stop: int) -> int:
    """The first index in [start, stop) where the two differ, else ``stop``; reads the
    tokens in chunks growing 4x, so an early difference costs little."""
    n, chunk = start, 1024
    while n < stop:
        end = min(stop, n + chunk)
        diff = np.flatnonzero(known[n:end] != np.asarray(token_ids[n:end], dtype=known.dtype))
        if diff.size:
            return n + int(diff[0])
        n, chunk = end, chunk * 4
    return stop
