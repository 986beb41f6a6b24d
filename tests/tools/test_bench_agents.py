"""tools/benchmarks/agents.py: the device tier's split it reports for a hybrid model."""

from __future__ import annotations

from tools.benchmarks.agents import device_tier
from wire.lifecycle import EngineLimits


def test_device_tier_counts_state_slots_beside_kv_blocks() -> None:
    limits = EngineLimits(vocab_size=8, max_model_len=64, eos_token_ids=(3,),
                          num_device_blocks=30, num_host_blocks=0, kv_bytes_per_block=100,
                          num_state_slots=10, state_bytes_per_slot=100)
    tier = device_tier(limits)
    assert (tier["kv_bytes"], tier["state_bytes"]) == (3000, 1000)
    assert tier["state_share"] == 0.25


def test_device_tier_of_a_model_without_state() -> None:
    limits = EngineLimits(vocab_size=8, max_model_len=64, eos_token_ids=(3,),
                          num_device_blocks=30, num_host_blocks=0, kv_bytes_per_block=100)
    assert device_tier(limits)["state_share"] == 0.0
