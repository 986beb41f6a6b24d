"""A hybrid model's device budget split between KV blocks and state slots
(worker/budget.py split_state_budget)."""

from __future__ import annotations

import pytest

from worker.budget import (
    StartupError,
    host_state_slots_for,
    host_tier_blocks,
    split_state_budget,
)


@pytest.mark.parametrize("budget,block,state,seqs,interval", [
    (10_000_000, 65_536, 1_048_576, 4, 4),
    (10_000_000, 65_536, 1_048_576, 4, 1),
    (1 << 30, 131_072, 3_000_000, 64, 8),
    (5_000_000, 4_096, 40_000, 1, 3),
])
def test_the_split_fits_the_budget_and_leaves_little(budget, block, state, seqs, interval):
    split = split_state_budget(budget, block, state, seqs, interval)
    assert split.num_live_slots == seqs
    assert split.num_snapshot_slots == split.num_device_blocks // interval
    used = split.num_device_blocks * block + split.num_state_slots * state
    assert used <= budget
    # one more block (and its share of a snapshot) would not fit
    assert used + block + state > budget


def test_without_prefix_caching_no_snapshot_slots():
    split = split_state_budget(10_000_000, 65_536, 1_048_576, 4, 4, prefix_caching=False)
    assert split.num_snapshot_slots == 0
    assert split.num_device_blocks == (10_000_000 - 4 * 1_048_576) // 65_536


def test_a_budget_without_room_for_the_live_states_is_refused():
    with pytest.raises(StartupError, match="max-num-seqs 64"):
        split_state_budget(10_000_000, 65_536, 1_048_576, 64, 4)


def test_the_host_tier_keeps_a_snapshot_every_interval_blocks_within_its_budget():
    budget, block, state = 64 << 20, 16_384, 116_736
    n = host_tier_blocks(budget, block, state, 4)
    slots = host_state_slots_for(n, 4)
    assert slots == n // 4 and n * block + slots * state <= budget
    assert (n + 4) * block + (slots + 1) * state > budget, "room for more was left"
    assert host_tier_blocks(budget, block, 0, 4) == budget // block  # no state: all KV
    assert host_tier_blocks(0, block, state, 4) == 0
