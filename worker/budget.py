"""What a rank decides at start-up before it allocates anything: the dtype, the context
length and the device tier's size, each checked against the model and the machine.

Every refusal names the figures on both sides, so a user can fix the flag at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from wire.config import FP8_ON_CUDA, SNAPSHOT_INTERVAL_AUTO, EngineConfig
from worker.kv_quant import FP8_DTYPES, SCALE_BYTES
from worker.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The automatic device tier (--kv-cache-memory 0) holds this many full-length sequences...
AUTO_NUM_SEQUENCES = 4
# ... within this share of the memory the machine has free at start-up, split among the
# ranks on this host (the weights, activations and the host tier need the rest).
AUTO_MEMORY_SHARE = 0.4

log = structlog.get_logger()


class StartupError(ValueError):
    """A setting the model or the machine cannot honour; the rank refuses to start."""


def cpu_flags() -> set[str]:
    """Every flag of the CPU's first `flags` (x86) or `Features` (Arm) line in /proc/cpuinfo;
    empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith(("flags", "Features"))), set())


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # a CPU's bf16 instructions, x86 and Arm


def cpu_bf16_flags() -> list[str]:
    """The CPU's bf16 instructions (x86 avx512_bf16 / amx_bf16, Arm bf16); empty without
    them (a bf16 matmul is then emulated: measured 0.3 GFLOP/s against 105 in float32 on
    an AVX2-only EPYC)."""
    have = cpu_flags()
    return [f for f in BF16_FLAGS if f in have]


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA; on CPU bfloat16 only where the processor
    has bf16 instructions, float32 otherwise."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES.get(checkpoint_dtype, torch.bfloat16)
    flags = cpu_bf16_flags()
    dtype = torch.bfloat16 if flags else torch.float32
    log.info("dtype_auto", dtype=str(dtype).removeprefix("torch."),
             why=f"the CPU has {', '.join(flags)}" if flags
             else "the CPU has no bf16 instructions (bf16 would be emulated, far slower)")
    return dtype


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device,
                     head_dim: int) -> torch.dtype:
    """What the KV tiers store: `auto`, the model's dtype; `fp8` / `fp8_e4m3` / `fp8_e5m2`,
    FP8 with a scale per token and KV head (worker/kv_quant.py), on CPU only."""
    if name == "auto":
        return dtype
    if device.type == "cuda":
        raise StartupError(FP8_ON_CUDA.format(name))
    kv_dtype = FP8_DTYPES[name]
    log.info("kv_cache_dtype", kv_dtype=str(kv_dtype).removeprefix("torch."),
             dtype=str(dtype).removeprefix("torch."),
             tokens_per_byte_vs_dtype=round(
                 head_dim * dtype.itemsize / (head_dim + SCALE_BYTES), 3))
    return kv_dtype


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The context length served: the model's, or a shorter one asked for; a longer one
    is refused (it would read positions the model was never trained on)."""
    limit, why = model.max_context, "its max_position_embeddings (times its rope factor)"
    if model.sliding_window and model.sliding_window < limit:
        # Sliding-window attention is not implemented; up to the window it is plain
        # causal attention, so the context is capped there.
        limit, why = model.sliding_window, "its sliding window (not implemented past it)"
    if config.max_model_len > limit:
        raise StartupError(f"--max-model-len {config.max_model_len} is above what the model "
                           f"supports: {limit} tokens ({why})")
    return config.max_model_len or limit


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def device_tier_bytes(config: EngineConfig, block_bytes: int, max_model_len: int,
                      device: torch.device, local_world_size: int, state_bytes: int = 0,
                      interval: int = 1) -> int:
    """The device tier's budget on this rank: --kv-cache-memory, or (0, the default) room
    for the KV of AUTO_NUM_SEQUENCES full-length sequences, within AUTO_MEMORY_SHARE of the
    free memory. A hybrid model (`state_bytes` a state slot, a snapshot every `interval`
    blocks) asks for its state slots on top, so that the split (`split_state_budget`)
    still leaves those sequences' blocks."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    num_blocks = AUTO_NUM_SEQUENCES * -(-max_model_len // config.block_size)
    wanted = (device_budget_for(num_blocks, block_bytes, state_bytes, config.max_num_seqs,
                                interval, config.enable_prefix_caching) if state_bytes
              else num_blocks * block_bytes)
    room = int(free_memory_bytes(device) * AUTO_MEMORY_SHARE) // max(1, local_world_size)
    budget = min(wanted, room)
    log.info("kv_budget_auto", bytes=budget, tokens=num_blocks * config.block_size,
             wanted_bytes=wanted, room_bytes=room, sequences=AUTO_NUM_SEQUENCES,
             state_bytes=wanted - num_blocks * block_bytes)
    return budget


def check_holds_one_sequence(num_blocks: int, block_size: int, block_bytes: int,
                             max_model_len: int,
                             budget_for: Callable[[int], int] | None = None) -> None:
    """The device tier must hold one sequence of the full context, or a request the
    context allows could never run (as vLLM refuses to start). `budget_for`: the budget
    that gives n blocks, where it is more than their bytes (a hybrid's state slots)."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        least = budget_for(needed) if budget_for else needed * block_bytes
        raise StartupError(
            f"the device KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks "
            f"of {block_size}), less than one sequence of the full context "
            f"({max_model_len} tokens): give --kv-cache-memory at least "
            f"{least} bytes per rank, or lower --max-model-len")


@dataclass(frozen=True)
class StateBudget:
    """A hybrid model's device tier: KV blocks for the attention layers, and state slots
    for the linear-attention layers (worker/linear_state.py): one live slot per sequence
    that may run, and the snapshots a prefix hit restores (cache/state_pool.py)."""

    num_device_blocks: int
    num_live_slots: int
    num_snapshot_slots: int

    @property
    def num_state_slots(self) -> int:
        return self.num_live_slots + self.num_snapshot_slots


def split_state_budget(budget_bytes: int, block_bytes: int, state_bytes: int,
                       max_num_seqs: int, interval: int,
                       prefix_caching: bool = True) -> StateBudget:
    """Split a rank's device-tier budget between KV blocks and state slots. Each running
    sequence needs a live slot (max_num_seqs of them); with a snapshot every `interval`
    blocks (--state-snapshot-interval), every `interval` blocks carry one snapshot, so
    what is left, B - live, holds n blocks and n / interval snapshots:
    n = (B - live) / (block_bytes + state_bytes / interval). Without prefix caching no
    snapshot is ever taken. (The last-boundary snapshots of the sequences share the same
    slots: they replace one another, and the pool evicts as it needs.)"""
    live_bytes = max_num_seqs * state_bytes
    left = budget_bytes - live_bytes
    if left < block_bytes:
        raise StartupError(
            f"the device tier's {budget_bytes} bytes per rank do not hold the linear-attention "
            f"state of --max-num-seqs {max_num_seqs} sequences ({state_bytes} bytes each, "
            f"{live_bytes} in all) and KV blocks beside it: give --kv-cache-memory more, or "
            "lower --max-num-seqs")
    if not prefix_caching:
        return StateBudget(left // block_bytes, max_num_seqs, 0)
    num_blocks = left * interval // (interval * block_bytes + state_bytes)
    return StateBudget(num_blocks, max_num_seqs, num_blocks // interval)


def device_budget_for(num_blocks: int, block_bytes: int, state_bytes: int,
                      max_num_seqs: int, interval: int, prefix_caching: bool = True) -> int:
    """The least device-tier budget that `split_state_budget` splits into `num_blocks` KV
    blocks (its inverse): the live slots, the blocks, and a snapshot per `interval` of
    them."""
    live_bytes = max_num_seqs * state_bytes
    if not prefix_caching:
        return live_bytes + num_blocks * block_bytes
    return live_bytes + -(-num_blocks * (interval * block_bytes + state_bytes) // interval)


# `--state-snapshot-interval auto` never snapshots more often than this: the former fixed
# default (on the tiny hybrid 2 gained half a point of hits, 1 lost 5.5: BENCHMARKS.md)
MIN_AUTO_SNAPSHOT_INTERVAL = 4


def auto_snapshot_interval(state_bytes: int, block_bytes: int) -> int:
    """`--state-snapshot-interval auto`: a snapshot every as many KV blocks as its bytes
    are worth (at least MIN_AUTO_SNAPSHOT_INTERVAL), so the snapshots take no more bytes
    of a tier than the KV blocks they come with: at most half of it (beside the live
    slots). The price is the granularity of a hit: the KV past its last snapshot, fewer
    than `interval` blocks, is computed again. A fixed interval costs more where a
    snapshot is large: every 4 blocks, a real Qwen3-Next's snapshots would take 98% of
    every tier.

    Per rank, from the checkpoints' shapes (16-token blocks; conv windows and KV in the
    dtype, recurrent matrices in float32; both shrink alike with tensor parallelism), as
    tests/worker/test_state_budget.py computes them:

    | model | state slot | KV block | interval |
    | --- | ---: | ---: | ---: |
    | tiny-qwen3-5 (the tests'), float32 | 116,736 B | 16,384 B | 8 |
    | tiny-qwen3-5, bfloat16 | 107,520 B | 8,192 B | 14 |
    | Qwen3-Next-80B-A3B, bfloat16, 1 rank | 77,266,944 B | 393,216 B | 197 |
    | Qwen3.5-27B, bfloat16, 1 rank | 153,944,064 B | 1,048,576 B | 147 |
    """
    return max(MIN_AUTO_SNAPSHOT_INTERVAL, -(-state_bytes // block_bytes))


def resolve_snapshot_interval(asked: int, state_bytes: int, block_bytes: int,
                              agree: Callable[[int], int]) -> int:
    """The snapshot interval a hybrid model's rank uses: `--state-snapshot-interval` as
    given, or under `auto` (SNAPSHOT_INTERVAL_AUTO) `auto_snapshot_interval` of this rank's
    figures, agreed across the ranks by `agree` (the maximum: every rank must snapshot at
    the same blocks, and none may find its snapshots past half of its tiers)."""
    interval = asked or agree(auto_snapshot_interval(state_bytes, block_bytes))
    log.info("state_snapshot_interval", blocks=interval,
             auto=asked == SNAPSHOT_INTERVAL_AUTO, state_bytes_per_slot=state_bytes,
             kv_bytes_per_block=block_bytes,
             snapshot_in_blocks=round(state_bytes / block_bytes, 2))
    return interval


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def state_slots_for(num_device_blocks: int, max_num_seqs: int, interval: int,
                    prefix_caching: bool = True) -> int:
    """A hybrid model's state slots beside `num_device_blocks` KV blocks: a live slot for
    every sequence that may run, and a snapshot for every `interval` blocks (none without
    prefix caching), as `split_state_budget` sizes them; also where the blocks were given
    rather than sized from the budget."""
    return max_num_seqs + (num_device_blocks // interval if prefix_caching else 0)


def host_tier_blocks(budget_bytes: int, block_bytes: int, state_bytes: int,
                     interval: int) -> int:
    """The host tier's KV blocks in --host-cache-memory: all of it, or for a hybrid model
    (`state_bytes` a slot, else 0) the same split as the device's, less the live slots
    (nothing runs there): n blocks and n / interval snapshots (cache/state_host.py),
    n = B / (block_bytes + state_bytes / interval)."""
    if not state_bytes:  # no snapshots: `interval` means nothing (0 for a model without)
        return budget_bytes // block_bytes
    return budget_bytes * interval // (interval * block_bytes + state_bytes)


def host_state_slots_for(num_host_blocks: int, interval: int) -> int:
    """A hybrid model's host snapshot slots beside `num_host_blocks`, as
    `host_tier_blocks` sizes them (from the blocks every rank agreed on)."""
    return num_host_blocks // interval


def device_blocks_for(budget: int, block_bytes: int, state_bytes: int, interval: int,
                      config: EngineConfig) -> int:
    """The KV blocks of a device tier of `budget` bytes: all of it, or, for a hybrid model
    (`state_bytes` a slot), what its state slots leave (`split_state_budget`)."""
    if not state_bytes:
        return budget // block_bytes
    return split_state_budget(budget, block_bytes, state_bytes, config.max_num_seqs,
                              interval, config.enable_prefix_caching).num_device_blocks
