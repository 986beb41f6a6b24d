"""A plan's moves between a rank's tiers, in the plan's order: KV blocks between device and
host (swap_out, swap_in), the host tier's disk reads and writes, and a hybrid model's state
slots the same way (wire/step.py has the order; cache/tier_moves.py plans them)."""

from __future__ import annotations

from wire.step import StepPlan
from worker.disk_tier import RankDiskTier
from worker.kv_cache import KVCache
from worker.linear_state import LinearStateCache


def apply_tier_moves(plan: StepPlan, kv: KVCache, disk: RankDiskTier | None,
                     state: LinearStateCache | None, num_host_blocks: int) -> None:
    for slot in [h for _, h in plan.swap_out] + [h for h, _ in plan.swap_in]:
        assert 0 <= slot < num_host_blocks, f"host slot {slot} out of range"
    if plan.disk_write or plan.disk_read:
        # the plan's order: swap_out, the disk ops (a write copies what swap_out left in
        # the host slot; a read fills the host slot a swap_in takes), then swap_in
        assert disk is not None, "a disk op without a disk tier"
        disk.join([s for _, s in plan.swap_out])
        kv.swap(plan.swap_out, [])
        kv.sync_copies()
        disk.apply(plan)
        disk.join([s for s, _ in plan.swap_in])
        kv.swap([], plan.swap_in)
    else:
        if disk is not None:  # a read in flight into a slot a copy touches
            disk.join([s for _, s in plan.swap_out] + [s for s, _ in plan.swap_in])
        kv.swap(plan.swap_out, plan.swap_in)
    if (plan.state_copy or plan.state_swap_out or plan.state_swap_in
            or plan.state_disk_write or plan.state_disk_read):
        # after the KV swaps, before the closes (wire/step.py)
        assert state is not None, "a state op for a model that keeps no state"
        if plan.state_disk_write or plan.state_disk_read:
            # swap_out, the disk ops (a write copies what swap_out left in the host
            # slot; a read fills a host slot a later plan swaps in), then the rest
            disk.join([h for _, h in plan.state_swap_out], states=True)
            state.apply(plan.state_swap_out, [], [])
            state.sync()
            disk.apply_states(plan)
            disk.join([h for h, _ in plan.state_swap_in], states=True)
            state.apply([], plan.state_copy, plan.state_swap_in)
        else:
            if disk is not None:  # a read in flight into a slot a copy touches
                disk.join([h for _, h in plan.state_swap_out]
                          + [h for h, _ in plan.state_swap_in], states=True)
            state.apply(plan.state_swap_out, plan.state_copy, plan.state_swap_in)
