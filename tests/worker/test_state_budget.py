"""A hybrid model's tiers split between KV blocks and state slots (worker/budget.py
split_state_budget, host_tier_blocks), the automatic device budget that leaves room for
the state, and `--state-snapshot-interval auto` (auto_snapshot_interval)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import HYBRID_MODELS, REPO, free_port, subprocess_env
from wire.config import SNAPSHOT_INTERVAL_AUTO, EngineConfig
from worker.budget import (
    AUTO_NUM_SEQUENCES,
    StartupError,
    auto_snapshot_interval,
    check_holds_one_sequence,
    device_budget_for,
    device_tier_bytes,
    host_state_slots_for,
    host_tier_blocks,
    resolve_snapshot_interval,
    split_state_budget,
)
from worker.distributed import TensorParallelGroup
from worker.hybrid_model import state_bytes_per_slot
from worker.kv_cache import KVCache
from worker.model_config import ModelConfig, load_model_config
from worker.model_runner import ModelRunner


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


# --- the device tier's automatic budget counts the state ---------------------------------


@pytest.mark.parametrize("num_blocks,block,state,seqs,interval,caching", [
    (2048, 16_384, 116_736, 64, 8, True),  # tiny-qwen3-5 in float32, `auto`
    (2048, 16_384, 116_736, 64, 1, True),
    (513, 4_096, 40_000, 3, 3, True),
    (100, 65_536, 1_048_576, 4, 4, False),
])
def test_device_budget_for_is_the_least_budget_the_split_gives_the_blocks(
        num_blocks, block, state, seqs, interval, caching):
    budget = device_budget_for(num_blocks, block, state, seqs, interval, caching)
    assert split_state_budget(budget, block, state, seqs, interval,
                              caching).num_device_blocks == num_blocks
    assert split_state_budget(budget - 1, block, state, seqs, interval,
                              caching).num_device_blocks == num_blocks - 1


@pytest.mark.parametrize("interval", [1, 4, 8])
def test_the_automatic_device_budget_holds_full_length_sequences_beside_the_state(interval):
    """--kv-cache-memory 0 asks for AUTO_NUM_SEQUENCES full-length sequences: for a hybrid
    model the state slots come on top. It asked for their KV bytes alone, and the split
    left the tiny hybrid (64 live slots) too few blocks for one 2,048-token sequence at
    any interval (BENCHMARKS.md: "no start" at 1 and 2 even for 8,192 tokens)."""
    block, state, max_model_len = 16_384, 116_736, 2048
    config = EngineConfig(model="/m")
    budget = device_tier_bytes(config, block, max_model_len, torch.device("cpu"), 1,
                               state, interval)
    split = split_state_budget(budget, block, state, config.max_num_seqs, interval)
    assert split.num_device_blocks == AUTO_NUM_SEQUENCES * max_model_len // 16
    check_holds_one_sequence(split.num_device_blocks, 16, block, max_model_len)
    # a model without state: the blocks' bytes alone, as before
    assert device_tier_bytes(config, block, max_model_len, torch.device("cpu"),
                             1) == AUTO_NUM_SEQUENCES * max_model_len // 16 * block


def test_a_hybrid_runner_starts_on_the_automatic_budget():
    """The tiny hybrid at --max-model-len 2048 with no --kv-cache-memory: it refused to
    start ("the device KV cache holds 464 tokens"), the state slots having taken the
    budget sized for KV alone."""
    runner = ModelRunner(EngineConfig(model=str(HYBRID_MODELS["qwen3_5"]), dtype="float32",
                                      max_model_len=2048),
                         TensorParallelGroup(0, 1), torch.device("cpu"))
    assert runner.state_snapshot_interval == 8  # `auto`, below
    assert runner.num_device_blocks >= AUTO_NUM_SEQUENCES * 2048 // 16


def test_a_refusal_names_a_budget_that_holds_the_sequence_beside_the_state():
    block, state, seqs, interval = 16_384, 116_736, 64, 8
    needed = 4096 // 16

    def budget_for(n: int) -> int:
        return device_budget_for(n, block, state, seqs, interval)

    with pytest.raises(StartupError, match="at least") as refused:
        check_holds_one_sequence(needed - 1, 16, block, 4096, budget_for)
    asked = int(str(refused.value).split("at least ")[1].split()[0])
    assert asked == budget_for(needed) > needed * block
    assert split_state_budget(asked, block, state, seqs, interval).num_device_blocks == needed


# --- --state-snapshot-interval auto ------------------------------------------------------


def shapes(tmp_path: Path, **config) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model_config(tmp_path)


def figures(model: ModelConfig, world_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(one state slot's bytes, one KV block's bytes) on a rank, as the runner takes them."""
    state = state_bytes_per_slot(model, world_size, dtype)
    block = KVCache.bytes_per_block(model.num_kv_layers, 16, model.num_kv_heads // world_size,
                                    model.head_dim, dtype)
    return state, block


# From the checkpoints' config.json (Qwen/Qwen3-Next-80B-A3B-Instruct) and model card
# (Qwen/Qwen3.5-27B: 64 layers, 3 Gated DeltaNet to 1 attention, 16 QK and 48 V linear heads
# of 128, 24 query and 4 KV heads of 256), the fields that size the state and the KV.
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], hidden_size=2048, intermediate_size=5120,
    num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, vocab_size=151936, max_position_embeddings=262144)
QWEN3_5_27B = dict(
    architectures=["Qwen3_5ForCausalLM"], hidden_size=5120, intermediate_size=17408,
    num_hidden_layers=64, full_attention_interval=4, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    vocab_size=248320, max_position_embeddings=262144)


@pytest.mark.parametrize("arch", sorted(HYBRID_MODELS))
def test_auto_on_the_tiny_hybrids(arch):
    """A tiny hybrid's snapshot is worth 7.1 KV blocks in float32 (the tests' dtype) and
    13.1 in bfloat16 (its one attention layer's KV is small beside three layers' 8 heads
    of 32x32 float32 matrices): `auto` snapshots every 8 and 14 blocks, not the former
    default 4, at which the snapshots took 64% (float32) of what a tier gives KV and
    snapshots."""
    model = load_model_config(HYBRID_MODELS[arch])
    assert figures(model, 1, torch.float32) == (116_736, 16_384)
    assert auto_snapshot_interval(*figures(model, 1, torch.float32)) == 8
    assert figures(model, 1, torch.bfloat16) == (107_520, 8_192)
    assert auto_snapshot_interval(*figures(model, 1, torch.bfloat16)) == 14
    # the same at any tensor-parallel size: both shrink alike
    assert auto_snapshot_interval(*figures(model, 2, torch.float32)) == 8


@pytest.mark.parametrize("config,world_sizes,state_bytes,block_bytes,interval", [
    (QWEN3_NEXT_80B, (1, 2), 77_266_944, 393_216, 197),
    (QWEN3_5_27B, (1, 2, 4), 153_944_064, 1_048_576, 147),
])
def test_auto_on_real_checkpoints_shapes(tmp_path, config, world_sizes, state_bytes,
                                         block_bytes, interval):
    """Per rank, in bfloat16: a Qwen3-Next-80B snapshot is worth 197 KV blocks, a
    Qwen3.5-27B one 147. At a snapshot every 4 blocks the snapshots took 98% of a tier's
    bytes; `auto` keeps them to at most half (the share below: snapshot bytes against
    those of the blocks they come with, and the two together)."""
    model = shapes(tmp_path, **config)
    for world in world_sizes:
        state, block = figures(model, world, torch.bfloat16)
        assert (state * world, block * world) == (state_bytes, block_bytes)
        assert auto_snapshot_interval(state, block) == interval

    def share(k: int) -> float:
        return state_bytes / (state_bytes + k * block_bytes)

    assert share(4) > 0.97 and share(interval) <= 0.5 < share(interval - 1)


def test_auto_snapshots_at_least_every_4_blocks():
    assert auto_snapshot_interval(1, 16_384) == 4
    assert auto_snapshot_interval(4 * 16_384, 16_384) == 4
    assert auto_snapshot_interval(4 * 16_384 + 1, 16_384) == 5


def test_an_explicit_interval_is_kept():
    one_rank = TensorParallelGroup(0, 1)
    assert resolve_snapshot_interval(3, 77_266_944, 393_216, one_rank.all_max) == 3
    assert resolve_snapshot_interval(SNAPSHOT_INTERVAL_AUTO, 77_266_944, 393_216,
                                     one_rank.all_max) == 197


RESOLVE_ON_A_RANK = """
import torch
from worker.budget import resolve_snapshot_interval
from worker.distributed import RankInfo, init_tensor_parallel, shutdown_tensor_parallel

info = RankInfo.from_env()
tp = init_tensor_parallel(info, torch.device("cpu"))
state = {states}[info.rank]
print("interval", resolve_snapshot_interval(0, state, 16_384, tp.all_max), flush=True)
shutdown_tensor_parallel()
"""


def test_ranks_with_other_figures_agree_on_the_largest_interval():
    """Two gloo ranks whose own figures give 8 and 20: both snapshot every 20 blocks (the
    scheduler holds every rank to the same EngineLimits, scheduler/engine.py)."""
    states = [116_736, 20 * 16_384]
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", RESOLVE_ON_A_RANK.format(states=states)], cwd=REPO,
        env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    chosen = [next(line.split()[1] for line in out.splitlines()
                   if line.startswith("interval ")) for out in outs]
    assert chosen == ["20", "20"], outs
