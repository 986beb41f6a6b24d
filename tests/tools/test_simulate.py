"""The simulator runs the real scheduler in virtual time and agrees with the real engine."""

from __future__ import annotations

import time

import pytest

from scheduler.engine import EngineCore
from tests.scheduler.engine_harness import inprocess_engine
from tools.sim.costs import HardwareCostModel
from tools.sim.presets import HARDWARE, MODELS
from tools.simulate import CostModel, Scenario, main, run_scenario, simulate

SMALL = Scenario(agents=3, context_tokens=400, shared_tokens=160, turns=3, turn_tokens=40,
                 output_tokens=6, active_wait_s=0.01, idle_wait_s=0.05, idle_share=0.2,
                 vocab_size=8000, count_first_turn=True, sessions_per_agent=2)


def test_simulation_runs_end_to_end_on_small_settings(capsys):
    assert main(["--agents", "4", "--context-tokens", "3000", "--shared-tokens", "1000",
                 "--turns", "3", "--turn-tokens", "200", "--output-tokens", "20",
                 "--device-tokens", "20000", "--host-tokens", "100000"]) == 0
    out = capsys.readouterr().out
    assert "hit ratio" in out and "deployment 96%" in out


def test_cost_model_and_real_engine_agree_on_hit_ratio(default_model):
    core: EngineCore = inprocess_engine(default_model, kv_cache_memory=32 << 20,
                                        max_num_batched_tokens=512)
    real = run_scenario(core, SMALL, time.monotonic)
    blocks = core.scheduler.limits.num_device_blocks
    sim = simulate(SMALL, CostModel(), blocks * 16, 0, "write_back", True, 512, "sim")
    assert real["prompt_tokens"] == sim["prompt_tokens"]
    # within a few points: which first turns overlap (and so miss the shared prompt
    # that a neighbour is still computing) depends on timing, wall clock vs virtual
    assert abs(real["hit_ratio"] - sim["hit_ratio"]) < 0.05, (real, sim)
    assert sim["hit_ratio"] > 0.5


HONEST_SMALL = Scenario(agents=3, context_tokens=400, shared_tokens=160, turns=3,
                        turn_tokens=40, output_tokens=6, active_wait_s=0.01, idle_wait_s=0.05,
                        idle_share=0.2, vocab_size=8000, count_first_turn=True,
                        sessions_per_agent=2, new_session_share=0.25, new_session_tokens=200,
                        compaction_share=0.25, compacted_tokens=120, long_idle_share=0.1,
                        long_idle_s=0.1)


def test_hardware_cost_model_and_real_engine_agree_with_new_sessions_and_compactions(
        default_model):
    core: EngineCore = inprocess_engine(default_model, kv_cache_memory=32 << 20,
                                        max_num_batched_tokens=512)
    real = run_scenario(core, HONEST_SMALL, time.monotonic)
    blocks = core.scheduler.limits.num_device_blocks
    cost = HardwareCostModel(MODELS["llama-3.1-8b"], HARDWARE["4xb200"], tp=4)
    sim = simulate(HONEST_SMALL, cost, blocks * 16, 0, "write_back", True, 512, "sim")
    assert real["prompt_tokens"] == sim["prompt_tokens"]
    for way in ("with_first_turns", "without_warmup"):
        assert abs(real[way]["hit_ratio"] - sim[way]["hit_ratio"]) < 0.05, (way, real, sim)
    assert sim["without_warmup"]["hit_ratio"] > sim["with_first_turns"]["hit_ratio"]


def test_compaction_breaks_the_prefix_after_the_shared_tokens():
    base = dict(agents=2, context_tokens=2_000, shared_tokens=512, turns=4, turn_tokens=64,
                output_tokens=4, active_wait_s=0.01, idle_share=0.0, sessions_per_agent=1,
                vocab_size=8000)
    cost = HardwareCostModel(MODELS["llama-3.1-8b"], HARDWARE["4xb200"], tp=4)
    plain = simulate(Scenario(**base), cost, 200_000, 0, "write_back", True, 4096, "plain")
    compacted = simulate(Scenario(**base, compaction_share=1.0, compacted_tokens=1_000), cost,
                         200_000, 0, "write_back", True, 4096, "compacted")
    # every later turn follows a compaction: only the shared 512 tokens (32 blocks) hit
    steady = compacted["without_warmup"]
    turns = 2 * 3
    assert steady["prompt_tokens"] == turns * (512 + 1_000)
    assert steady["hit_ratio"] == pytest.approx(512 / (512 + 1_000))
    assert plain["without_warmup"]["hit_ratio"] > 0.9
    assert compacted["read_tokens_per_s"] < plain["read_tokens_per_s"]


def test_simulation_from_presets_prints_the_capacities(capsys):
    assert main(["--model-preset", "llama-3.1-8b", "--hardware-preset", "4xb200",
                 "--agents", "2", "--context-tokens", "3000", "--shared-tokens", "1000",
                 "--turns", "2", "--turn-tokens", "200", "--output-tokens", "8", "--honest",
                 "--tier-scale", "0.01", "--compare-no-host"]) == 0
    out = capsys.readouterr().out
    assert "32.0 KiB of KV per token per rank" in out and "48,213 tokens" in out
    assert "no host tier" in out and "without warmup" in out


def test_a_model_that_does_not_fit_the_node_is_refused(capsys):
    assert main(["--model-preset", "deepseek-v3", "--hardware-preset", "4xb200",
                 "--agents", "1", "--context-tokens", "1000", "--shared-tokens", "100"]) == 1
    assert "do not leave room for a device tier" in capsys.readouterr().out
