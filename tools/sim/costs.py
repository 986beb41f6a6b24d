"""Seconds per step for a model on a machine, from published figures (the simulator's clock).

- **Decode** is bound by HBM reads: each step reads every weight once, and each sequence
  reads its KV. Calibrated on vLLM's figure for Llama-3.1-8B on one H100, 6.4 ms per
  step + 4.4e-5 ms per context token, which is ~75% of the H100's 3.35 TB/s
  for the 16 GB of weights and ~89% of it for the 128 KiB of KV per token. Another
  model/machine pair keeps those efficiencies: its fixed part is scaled by (weight bytes
  per GPU / HBM bandwidth), its per-token part by (KV bytes per rank / HBM bandwidth).
  The matmuls' compute (2 FLOPs per active parameter per sequence) is a floor, reached
  only at large batches. Tensor-parallel all-reduces are left out.
- **Prefill** is bound by compute: 2 FLOPs per active parameter per token plus attention
  over every (query, key) pair, at PREFILL_MFU of the node's dense BF16 peak (an assumed
  figure: FlashAttention-3 reports 60-75% of an H100's peak on long sequences, the linear
  layers run near it; 0.5 leaves room for the rest of a real step).
- **Tier copies**: one rank's share of a block over its own host link (the ranks copy in
  parallel). Contiguous 0.5-2 MB copies run at the link's ~50 GB/s one way; copies of a
  few KiB each run near 5 GB/s. Our engine copies a block layer by layer, K and V apart
  (`worker/kv_cache.py`: 2 x num_layers copies of block_size x kv_heads x head_dim
  elements, 8 KiB for Llama-3.1-8B at TP 4), so FRAGMENTED is the default.
- **Engine overhead** per step, from the first engine-overhead measurement (null model,
  world size 1, decode; docs/perf-log/2026-11-29-to-2026-12-03.md): 0.50 ms at batch 1 and
  9.7 ms at batch 256, i.e. ~0.5 ms + 36 us per sequence (BENCHMARKS.md has the current,
  lower figures). With overlap scheduling it runs behind the forward, so a
  step takes the longer of the two; without it, their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.sim.presets import (
    HARDWARE,
    MODELS,
    HardwarePreset,
    ModelPreset,
    kv_bytes_per_token_per_rank,
)


@dataclass(frozen=True)
class DecodeCalibration:
    model: str = "llama-3.1-8b"
    hardware: str = "1xh100"
    tp: int = 1
    fixed_s: float = 6.4e-3  # per decode step
    per_context_token_s: float = 4.4e-8  # per token of context read, summed over the batch


CALIBRATION = DecodeCalibration()
PREFILL_MFU = 0.5
DECODE_MFU = 0.5  # the compute floor's share of the peak at large decode batches
FRAGMENTED_COPY_BYTES_PER_S = 5e9
OVERHEAD_S_PER_STEP = 0.5e-3
OVERHEAD_S_PER_SEQ = 36e-6


def _read_seconds(nbytes: float, hw: HardwarePreset) -> float:
    return nbytes / hw.hbm_bytes_per_s


@dataclass(frozen=True)
class HardwareCostModel:
    """The simulator's cost interface (as `tools.sim.executor.CostModel`) from a model and a
    machine, with tensor parallelism over `tp` GPUs."""

    model: ModelPreset
    hardware: HardwarePreset
    tp: int
    block_size: int = 16
    prefill_mfu: float = PREFILL_MFU
    contiguous_copies: bool = False  # True: what a copy of whole blocks would get
    overlap: bool = True
    attention_dp: bool = False  # see kv_bytes_per_token_per_rank
    calibration: DecodeCalibration = CALIBRATION

    # The calibration pair's efficiencies: seconds measured / seconds of pure HBM reads.
    def _weight_efficiency(self) -> float:
        m, hw = MODELS[self.calibration.model], HARDWARE[self.calibration.hardware]
        return _read_seconds(m.weight_bytes_per_gpu(self.calibration.tp), hw) / \
            self.calibration.fixed_s

    def _kv_efficiency(self) -> float:
        m, hw = MODELS[self.calibration.model], HARDWARE[self.calibration.hardware]
        return _read_seconds(m.kv_bytes_per_token(self.calibration.tp), hw) / \
            self.calibration.per_context_token_s

    @property
    def decode_fixed_s(self) -> float:
        return _read_seconds(self.model.weight_bytes_per_gpu(self.tp), self.hardware) / \
            self._weight_efficiency()

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token_per_rank(self.model, self.tp, self.attention_dp)

    @property
    def decode_s_per_context_token(self) -> float:
        return _read_seconds(self.kv_bytes_per_token, self.hardware) / self._kv_efficiency()

    def decode_seconds(self, num_seqs: int, context_tokens: int = 0) -> float:
        """One decode step of `num_seqs` sequences reading `context_tokens` in all."""
        if not num_seqs:
            return 0.0
        memory = self.decode_fixed_s + context_tokens * self.decode_s_per_context_token
        compute = 2 * self.model.active_linear_params() * num_seqs / self._flops_per_s(
            DECODE_MFU)
        return max(memory, compute)

    def chunk_seconds(self, num_tokens: int, start_pos: int) -> float:
        """A prefill chunk of `num_tokens` after `start_pos` tokens already in the cache."""
        pairs = num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2
        flops = 2 * self.model.active_linear_params() * num_tokens + \
            self.model.attention_flops_per_pair() * pairs
        return flops / self._flops_per_s(self.prefill_mfu)

    def _flops_per_s(self, mfu: float) -> float:
        return self.tp * self.hardware.bf16_flops_per_s * mfu

    @property
    def block_bytes_per_rank(self) -> float:
        return self.block_size * self.kv_bytes_per_token

    @property
    def copy_bytes_per_s(self) -> float:
        return self.hardware.host_link_bytes_per_s if self.contiguous_copies else \
            FRAGMENTED_COPY_BYTES_PER_S

    @property
    def swap_s_per_block(self) -> float:
        """One block between the device and the host tier, one way (all ranks at once)."""
        return self.block_bytes_per_rank / self.copy_bytes_per_s

    @property
    def disk_s_per_block(self) -> float:
        """One block between host RAM and disk: the whole node's bytes of it through the
        node's drives. Unused until the cache has a disk tier."""
        return self.block_bytes_per_rank * self.tp / self.hardware.disk_bytes_per_s

    def step_seconds(self, forward_s: float, num_seqs: int) -> float:
        overhead = OVERHEAD_S_PER_STEP + OVERHEAD_S_PER_SEQ * num_seqs if num_seqs else 0.0
        return max(forward_s, overhead) if self.overlap else forward_s + overhead
