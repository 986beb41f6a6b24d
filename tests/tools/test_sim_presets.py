"""Capacities and copy costs from the presets, against values worked out by hand."""

from __future__ import annotations

import argparse
import json

import pytest

from tools.sim.costs import HardwareCostModel
from tools.sim.hardware_args import add_hardware_args, hardware_cost
from tools.sim.presets import HARDWARE, MODELS, model_from_config, tier_capacities

LLAMA_8B, B200 = MODELS["llama-3.1-8b"], HARDWARE["4xb200"]


def test_llama_8b_shapes_give_its_published_parameter_count():
    # HF lists 8,030,261,248 parameters; 266,240 of them are the RMSNorm weights
    # (2 x 32 layers x 4096 + 4096), which the preset leaves out.
    assert LLAMA_8B.params() + 2 * 32 * 4096 + 4096 == 8_030_261_248


def test_kv_bytes_per_token_per_rank():
    # K and V x 32 layers x (8 KV heads / TP) x 128 x 2 bytes
    assert LLAMA_8B.kv_bytes_per_token(1) == 131_072  # 128 KiB, the figure quoted for Llama-3.1-8B
    assert LLAMA_8B.kv_bytes_per_token(4) == 2 * 32 * 2 * 128 * 2 == 32_768
    assert LLAMA_8B.kv_bytes_per_token(16) == 2 * 32 * 1 * 128 * 2  # heads replicated past 8
    assert MODELS["llama-3.3-70b"].kv_bytes_per_token(1) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert MODELS["qwen3-32b"].kv_bytes_per_token(1) == 2 * 64 * 8 * 128 * 2 == 262_144
    # MLA: one latent of 512 + a 64-wide rope key per layer, the same on every rank
    assert MODELS["deepseek-v3"].kv_bytes_per_token(1) == 61 * 576 * 2 == 70_272
    assert MODELS["deepseek-v3"].kv_bytes_per_token(8) == 70_272


def test_tier_capacities_of_llama_8b_on_4x_b200():
    caps = tier_capacities(LLAMA_8B, B200)
    weights = 8_029_995_008 * 2 // 4  # bf16 over 4 ranks
    assert caps.tp == 4 and caps.weight_bytes_per_gpu == weights == 4_014_997_504
    room = 180 * 10**9 * 9 // 10 - weights  # 90% of 180 GB (vLLM's 0.9), less the weights
    assert caps.device_tier_bytes_per_gpu == room
    assert caps.device_tokens == room // 32_768 == 4_821_319
    # 80% of 2 TB of RAM, each token 32 KiB on each of the 4 ranks
    assert caps.host_tokens == 1_600 * 10**9 // (4 * 32_768) == 12_207_031


def test_data_parallel_attention_holds_each_token_once():
    lite = MODELS["deepseek-v2-lite"]
    tp_caps = tier_capacities(lite, B200)
    dp_caps = tier_capacities(lite, B200, attention_dp=True)
    assert tp_caps.kv_bytes_per_token == 27 * 576 * 2 == 31_104
    assert dp_caps.device_tokens == pytest.approx(4 * tp_caps.device_tokens, abs=4)
    assert dp_caps.host_tokens == pytest.approx(4 * tp_caps.host_tokens, abs=4)


def test_a_model_too_large_for_the_node_has_no_device_tier():
    caps = tier_capacities(MODELS["deepseek-v3"], B200)  # 671 GB of fp8 weights on 720 GB
    assert caps.weight_bytes_per_gpu == 671 * 10**9 // 4
    assert not caps.fits and caps.device_tokens == 0
    assert tier_capacities(MODELS["deepseek-v3"], HARDWARE["8xh200"]).fits


def test_copy_cost_per_block():
    cost = HardwareCostModel(LLAMA_8B, B200, tp=4)
    assert cost.block_bytes_per_rank == 16 * 32_768 == 524_288
    # the engine copies layer by layer (8 KiB pieces): ~5 GB/s
    assert cost.swap_s_per_block == pytest.approx(524_288 / 5e9)
    whole = HardwareCostModel(LLAMA_8B, B200, tp=4, contiguous_copies=True)
    assert whole.swap_s_per_block == pytest.approx(524_288 / 50e9)  # ~10.5 us
    # the disk-tier hook: the node's bytes of a block through 28 GB/s of NVMe
    assert cost.disk_s_per_block == pytest.approx(4 * 524_288 / 28e9)


def test_model_config_read_by_the_engines_loader(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = model_from_config(tmp_path / "config.json")
    assert m.kv_bytes_per_token(4) == LLAMA_8B.kv_bytes_per_token(4)
    assert m.params() == LLAMA_8B.params()


def _hardware_args(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_hardware_args(p)
    return vars(p.parse_args(argv))


def test_a_measured_disk_bandwidth_sets_the_disk_cost_per_block():
    preset = ["--model-preset", "llama-3.1-8b", "--hardware-preset", "4xb200"]
    default, _ = hardware_cost(_hardware_args(preset))
    assert default.disk_s_per_block == pytest.approx(4 * 524_288 / 28e9)  # the preset's
    measured, caps = hardware_cost(_hardware_args([*preset, "--disk-bytes-per-s", "2.5e9"]))
    assert measured.disk_s_per_block == pytest.approx(4 * 524_288 / 2.5e9)  # ~839 us
    # only the disk changes: the tiers and the other copies are the preset's
    assert caps == tier_capacities(LLAMA_8B, B200)
    assert measured.swap_s_per_block == default.swap_s_per_block
    with pytest.raises(SystemExit):
        hardware_cost(_hardware_args([*preset, "--disk-bytes-per-s", "0"]))
    with pytest.raises(SystemExit):  # without presets the cost is --disk-s-per-block
        hardware_cost(_hardware_args(["--disk-bytes-per-s", "2.5e9"]))
