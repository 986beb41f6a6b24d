"""The implied-model analysis of the deployment's figures, by hand."""

from __future__ import annotations

import pytest

from tools.sim.implied import (
    analyse,
    max_attention_flops_per_pair,
    max_kv_bytes_per_token,
    node_kv_bytes_per_token,
)
from tools.sim.presets import HARDWARE, MODELS


def test_57m_tokens_on_4x_b200_leave_about_12_kb_per_token():
    # 4 x 180 GB over 57M tokens (13.5 KB would count the 192 GB die, not the 180 usable)
    assert max_kv_bytes_per_token(HARDWARE["4xb200"], 57_000_000) == pytest.approx(
        4 * 180e9 / 57e6)


def test_the_raw_read_rate_bounds_attention_per_pair():
    # 9 PFLOPS / 200,000 tok/s = 45 GFLOP per token over a mean 225,000.5 keys each
    bound = max_attention_flops_per_pair(HARDWARE["4xb200"], 200_000, 450_000)
    assert bound == pytest.approx(4 * 2.25e15 / 200_000 / 225_000.5)
    assert bound < MODELS["llama-3.1-8b"].attention_flops_per_pair()


def test_real_models_host_tier_of_617m_tokens_needs_tens_of_terabytes():
    a = analyse()["models"]
    assert node_kv_bytes_per_token(MODELS["llama-3.1-8b"], 4) == 131_072
    assert a["llama-3.1-8b"]["ram_for_host_tokens_tb"] == pytest.approx(131_072 * 617e6 / 1e12)
    assert a["deepseek-v2-lite DP-attn"]["node_kv_bytes_per_token"] == 27 * 576 * 2
    assert all(r["ram_for_host_tokens_tb"] > 2 for r in a.values())  # 2 TB in the node
