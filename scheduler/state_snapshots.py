"""Where a hybrid model's chunks snapshot their linear-attention state (cache/state_pool.py).

A prefix hit on a hybrid model goes on from the state at its last block, so the state is
copied aside at block boundaries as chunks cross them: at every `interval`-th block
boundary (a flag, --state-snapshot-interval: each snapshot costs a slot of device memory,
budgeted beside the KV blocks, worker/budget.py), and at the last boundary each sequence
reached, which replaces the sequence's previous such one. An agent's next turn repeats
the conversation and adds to it, so it finds the state at the last full block of the turn
before, whatever the interval.
"""

from __future__ import annotations

from cache.manager import KVCacheManager


def snapshot_boundaries(start: int, end: int, block_size: int, interval: int) -> list[int]:
    """The block counts n whose boundary (token n * block_size) a chunk of tokens
    [start, end) reaches, and that get a snapshot: the multiples of `interval`, and the
    last one."""
    first, last = start // block_size + 1, end // block_size
    if last < first:
        return []
    out = list(range(-(-first // interval) * interval, last + 1, interval))
    if not out or out[-1] != last:
        out.append(last)
    return out


def take_snapshots(cache: KVCacheManager, seq_id: int, start: int, end: int,
                   interval: int) -> list[tuple[int, int]]:
    """The chunk's ScheduledChunk.state_snapshots, (tokens of the chunk consumed, slot),
    with a slot taken for each; a boundary no slot is left for goes without (a later hit
    starts from an earlier snapshot)."""
    bs = cache.block_size
    out = []
    for n in snapshot_boundaries(start, end, bs, interval):
        slot = cache.state.take_snapshot(seq_id, n, keep=n % interval == 0)
        if slot >= 0:
            out.append((n * bs - start, slot))
    return out
