"""The cost model reproduces the decode figure it is calibrated on and scales from it."""

from __future__ import annotations

import pytest

from tools.sim.costs import HardwareCostModel
from tools.sim.presets import HARDWARE, MODELS

LLAMA_8B = MODELS["llama-3.1-8b"]


def test_reproduces_vllm_llama_8b_decode_on_one_h100():
    cost = HardwareCostModel(LLAMA_8B, HARDWARE["1xh100"], tp=1)
    assert cost.decode_fixed_s == pytest.approx(6.4e-3)
    assert cost.decode_s_per_context_token == pytest.approx(4.4e-8)  # 4.4e-5 ms
    # 32 sequences of 4,000 tokens: 6.4 ms + 128,000 x 4.4e-5 ms = 12.03 ms
    assert cost.decode_seconds(32, 128_000) == pytest.approx(6.4e-3 + 128_000 * 4.4e-8)


def test_decode_scales_with_bytes_per_gpu_and_hbm_bandwidth():
    # TP 4 holds a quarter of the weights and of the KV per rank; a B200 reads 8 / 3.35
    # times as fast as an H100
    h100 = HardwareCostModel(LLAMA_8B, HARDWARE["4xh100"], tp=4)
    assert h100.decode_fixed_s == pytest.approx(6.4e-3 / 4)
    assert h100.decode_s_per_context_token == pytest.approx(4.4e-8 / 4)
    b200 = HardwareCostModel(LLAMA_8B, HARDWARE["4xb200"], tp=4)
    assert b200.decode_fixed_s == pytest.approx(6.4e-3 / 4 * 3.35 / 8)
    seventy = HardwareCostModel(MODELS["llama-3.3-70b"], HARDWARE["4xh100"], tp=4)
    assert seventy.decode_s_per_context_token == pytest.approx(4.4e-8 / 4 * 80 / 32)


def test_prefill_is_its_flops_at_the_stated_share_of_the_peak():
    cost = HardwareCostModel(LLAMA_8B, HARDWARE["4xb200"], tp=4)
    linear = 2 * 6_979_321_856  # the decoder layers' weights, 2 FLOPs each per token
    pair = 2 * 32 * 32 * (128 + 128)  # QK and PV per (query, key) pair, all layers and heads
    n, start = 1_000, 50_000
    pairs = n * start + n * (n + 1) // 2
    expected = (linear * n + pair * pairs) / (4 * 2.25e15 * 0.5)
    assert cost.chunk_seconds(n, start) == pytest.approx(expected)


def test_engine_overhead_hides_behind_the_forward_with_overlap():
    on = HardwareCostModel(LLAMA_8B, HARDWARE["4xb200"], tp=4)
    off = HardwareCostModel(LLAMA_8B, HARDWARE["4xb200"], tp=4, overlap=False)
    overhead = 0.5e-3 + 36e-6 * 64
    assert on.step_seconds(10e-3, 64) == 10e-3
    assert on.step_seconds(1e-3, 64) == pytest.approx(overhead)
    assert off.step_seconds(10e-3, 64) == pytest.approx(10e-3 + overhead)
