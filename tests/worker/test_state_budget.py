"""A hybrid model's device budget split between KV blocks and state slots
(worker/budget.py split_state_budget)."""

from __future__ import annotations

import pytest

from worker.budget import StartupError, split_state_budget


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
