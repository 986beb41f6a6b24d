"""Speculative decoding is refused for a hybrid model (linear-attention layers) by the
launcher, from the checkpoint's config.json, and by the scheduler, from what the ranks
report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config import is_hybrid_checkpoint
from scheduler.main import refuse_for_model
from wire.config import EngineConfig, SpeculativeConfig
from wire.lifecycle import EngineLimits


@pytest.mark.parametrize("config,hybrid", [
    ({"layer_types": ["linear_attention", "full_attention"]}, True),  # Qwen3-Next
    ({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}, True),  # 3.5
    ({"layer_types": ["full_attention", "sliding_attention"]}, False),
    ({"model_type": "qwen3"}, False),
    ([1, 2], False),
])
def test_a_hybrid_checkpoint_is_told_by_its_layer_types(tmp_path: Path, config, hybrid):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert is_hybrid_checkpoint(tmp_path) is hybrid


def test_no_config_is_not_hybrid(tmp_path: Path):
    assert not is_hybrid_checkpoint(tmp_path / "model.gguf")


def test_the_scheduler_refuses_drafts_for_a_hybrid_model():
    spec = EngineConfig(model="/m", speculative=SpeculativeConfig())
    hybrid = EngineLimits(1000, 512, (3,), 64, 0, num_state_slots=8, state_bytes_per_slot=1)
    plain = EngineLimits(1000, 512, (3,), 64, 0)
    assert "hybrid model" in refuse_for_model(spec, hybrid)
    assert refuse_for_model(spec, plain) == ""
    assert refuse_for_model(EngineConfig(model="/m"), hybrid) == ""
