"""Consistency checks of the cache's bookkeeping, kept apart from the manager's logic.

`accounting_problems` is cheap (O(live sequences), plain comparisons, no asserts so it
survives `python -O`) and runs after every engine step in production;
`check_invariants` walks every block (O(capacity)) and runs in tests, under
hypothesis, and every N steps in the engine when `--full-cache-check-every N` asks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cache.block_pool import DevicePool
from cache.host_pool import HostPool


def accounting_problems(seqs: dict[int, Any], device: DevicePool, host: HostPool,
                        live_seq_ids: set[int]) -> list[str]:
    """What is wrong, if anything: `seqs` are the manager's sequences (each with a
    `blocks` table), `live_seq_ids` those the caller holds open; any other sequence
    holding blocks is a leak."""
    d, h = device, host
    problems = []
    if set(seqs) != live_seq_ids:
        leaked = sorted(set(seqs) - live_seq_ids)[:8]
        unknown = sorted(live_seq_ids - set(seqs))[:8]
        problems.append(f"sequences holding blocks {leaked} not open; open {unknown} "
                        "holding none")
    held = sum(len(s.blocks) for s in seqs.values())
    if held != d.num_refs:
        problems.append(f"block tables hold {held} references, refcounts sum to {d.num_refs}")
    if d.num_used > held or (d.num_used == 0) != (held == 0):
        problems.append(f"{d.num_used} device blocks in use for {held} references")
    if d.num_free < 0 or d.num_cached < 0 or d.num_used < 0:
        problems.append(f"device counts free {d.num_free} cached {d.num_cached} "
                        f"used {d.num_used}")
    if h.free.count + h.lru.count + h.num_reserved != h.num_slots:
        problems.append(f"host slots: {h.free.count} free + {h.lru.count} cached + "
                        f"{h.num_reserved} reserved != {h.num_slots}")
    return problems


def check_invariants(seqs: dict[int, Any], device: DevicePool, host: HostPool,
                     ops: Any) -> None:
    """Every block's state against every table, and this step's queued tier copies
    (`ops`: swap_out [(block, slot)], swap_in [(slot, block)]). Raises AssertionError."""
    counts = np.zeros(device.num_blocks, dtype=np.int64)
    for sid, seq in seqs.items():
        b = np.frombuffer(seq.blocks.tobytes(), dtype=np.int32)
        assert len(np.unique(b)) == len(b), f"seq {sid} holds a block twice"
        counts[b] += 1
        assert seq.num_registered <= len(b)
    assert (counts == device.refcount).all(), "refcounts != live sequence references"
    device.check()
    host.check()
    for _, slot in ops.swap_out:
        assert host.pinned[slot]
    assert len({s for _, s in ops.swap_out}) == len(ops.swap_out), "host slot written twice"
    assert len({b for _, b in ops.swap_in}) == len(ops.swap_in), "block loaded twice"
    for slot, block in ops.swap_in:
        assert host.pinned[slot] and device.busy[block]
