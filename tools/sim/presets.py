"""Models and machines for the simulator, in bytes and FLOPs instead of tokens.

A `ModelPreset` says how many KV bytes one rank stores per token (given the tensor-parallel
degree), how many bytes of weights each GPU holds, and how many FLOPs a token costs; a
`HardwarePreset` says what a node has. `tier_capacities` turns the pair into the device-
and host-tier token counts the simulator's cache is built with.

Every figure has its public source beside it. Model shapes are those of each checkpoint's
`config.json` on the Hugging Face hub; hardware figures are the vendors' datasheets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 10**9  # datasheets count memory and bandwidth in decimal gigabytes


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # GQA: K/V heads; MLA: 1 (one latent per token, shared by all heads)
    head_dim: int  # GQA: per head; MLA: the query/key head dim (nope + rope), for FLOPs
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    weight_bytes_per_param: int = 2  # bf16; 1 for an fp8 checkpoint
    kv_bytes_per_elem: int = 2  # bf16 KV; 1 for an fp8 KV cache
    # MLA (DeepSeek-V2/V3, Kimi-K2): the cache holds a compressed latent of kv_lora_rank
    # plus the decoupled rope key of qk_rope_head_dim per token per layer, not K and V.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0  # MLA's value head dim (GQA: head_dim)
    # MoE checkpoints: their totals cannot be derived from a dense shape, so they are given.
    num_params: int = 0  # all weights (0: derive from the dense shape)
    num_active_params: int = 0  # weights a token multiplies through (0: all of them)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_heads_per_rank(self, tp: int) -> int:
        # With more ranks than KV heads, vLLM and SGLang replicate each head on tp/kv ranks.
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV bytes ONE rank stores per token. MLA's latent is not split by heads: under
        tensor parallelism every rank holds all of it (vLLM's MLA backends)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * \
                self.kv_bytes_per_elem
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * \
            self.kv_bytes_per_elem

    def dense_linear_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        return self.num_layers * (attn + 3 * h * self.intermediate_size)

    def params(self) -> int:
        if self.num_params:
            return self.num_params
        embed = self.vocab_size * self.hidden_size
        return self.dense_linear_params() + embed * (1 if self.tie_word_embeddings else 2)

    def active_linear_params(self) -> int:
        """Weights a token multiplies through (the embedding lookup is not a matmul; the LM
        head runs on sampled rows only, so it is left out too)."""
        if self.num_active_params:
            return self.num_active_params - self.vocab_size * self.hidden_size * 2
        return self.dense_linear_params()

    def weight_bytes_per_gpu(self, tp: int) -> int:
        return self.params() * self.weight_bytes_per_param // tp

    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers and heads: QK^T over the key dim
        and PV over the value dim, 2 FLOPs a multiply-add."""
        v = self.v_head_dim or self.head_dim
        return 2 * self.num_layers * self.num_heads * (self.head_dim + v)


# Shapes from each checkpoint's config.json on huggingface.co.
MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    # meta-llama/Llama-3.1-8B-Instruct: 8.03B parameters, 128 KiB of bf16 KV per token
    ModelPreset("llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32,
                num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
    # meta-llama/Llama-3.3-70B-Instruct: 70.6B parameters, 320 KiB per token
    ModelPreset("llama-3.3-70b", num_layers=80, hidden_size=8192, num_heads=64,
                num_kv_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256),
    # Qwen/Qwen3-32B: 32.8B parameters, 256 KiB per token
    ModelPreset("qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8,
                head_dim=128, intermediate_size=25600, vocab_size=151936),
    # deepseek-ai/DeepSeek-V3 (Kimi-K2 has the same attention): MLA, kv_lora_rank 512 +
    # qk_rope_head_dim 64 per layer, 61 layers -> 68.6 KiB per token in bf16, on every rank.
    # 671B parameters (37B active per token, the model card), shipped in fp8.
    ModelPreset("deepseek-v3", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=1,
                head_dim=192, intermediate_size=18432, vocab_size=129280,
                weight_bytes_per_param=1, kv_lora_rank=512, qk_rope_head_dim=64,
                v_head_dim=128, num_params=671 * 10**9, num_active_params=37 * 10**9),
    # deepseek-ai/DeepSeek-V2-Lite: the same MLA at a size 4 GPUs serve with room to
    # spare: 27 layers -> 30.4 KiB per token; 15.7B parameters (2.4B active), bf16.
    ModelPreset("deepseek-v2-lite", num_layers=27, hidden_size=2048, num_heads=16,
                num_kv_heads=1, head_dim=192, intermediate_size=10944, vocab_size=102400,
                kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
                num_params=15_700_000_000, num_active_params=2_400_000_000),
)}


@dataclass(frozen=True)
class HardwarePreset:
    name: str
    num_gpus: int
    hbm_bytes_per_gpu: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense (no sparsity) tensor-core peak, per GPU
    host_ram_bytes: int  # the node's
    host_link_bytes_per_s: float  # one way, per GPU, contiguous copies (measured, not nominal)
    disk_bytes_per_s: float  # the node's NVMe read rate: for the disk tier, when it exists


# Host links: PCIe Gen5 x16 is 64 GB/s nominal one way; contiguous pinned copies of 0.5-2 MB
# measure ~50 GB/s (vLLM's CPU-offloading write-up, LMCache's benchmarks). Disks: a U.2 Gen4
# NVMe drive reads ~7 GB/s (vendor sheets); DGX B200/H100/H200 carry 8 of them for 8 GPUs,
# so a 4-GPU node is taken to have 4 (28 GB/s) and an 8-GPU node 8 (56 GB/s).
HARDWARE: dict[str, HardwarePreset] = {p.name: p for p in (
    # NVIDIA DGX B200 datasheet: 1,440 GB of HBM3e for 8 GPUs (180 GB each, the 192 GB
    # die as shipped), 64 TB/s (8 TB/s each), 18 PFLOPS dense FP16/BF16 for 8 (2.25 each),
    # 2 TB of RAM for 8 GPUs (4 TB optional): a 4-GPU node is taken to have 2 TB.
    HardwarePreset("4xb200", num_gpus=4, hbm_bytes_per_gpu=180 * GB, hbm_bytes_per_s=8e12,
                   bf16_flops_per_s=2.25e15, host_ram_bytes=2000 * GB,
                   host_link_bytes_per_s=50e9, disk_bytes_per_s=28e9),
    # NVIDIA H200 datasheet: 141 GB of HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16 (SXM);
    # DGX H200: 2 TB of RAM.
    HardwarePreset("8xh200", num_gpus=8, hbm_bytes_per_gpu=141 * GB, hbm_bytes_per_s=4.8e12,
                   bf16_flops_per_s=989e12, host_ram_bytes=2000 * GB,
                   host_link_bytes_per_s=50e9, disk_bytes_per_s=56e9),
    # NVIDIA H100 datasheet: 80 GB of HBM3, 3.35 TB/s, 989 TFLOPS dense BF16 (SXM);
    # DGX H100 has 2 TB for 8 GPUs: a 4-GPU node is taken to have 1 TB.
    HardwarePreset("4xh100", num_gpus=4, hbm_bytes_per_gpu=80 * GB, hbm_bytes_per_s=3.35e12,
                   bf16_flops_per_s=989e12, host_ram_bytes=1000 * GB,
                   host_link_bytes_per_s=50e9, disk_bytes_per_s=28e9),
    # One H100 (vLLM's decode figures the cost model is calibrated on were measured there).
    HardwarePreset("1xh100", num_gpus=1, hbm_bytes_per_gpu=80 * GB, hbm_bytes_per_s=3.35e12,
                   bf16_flops_per_s=989e12, host_ram_bytes=250 * GB,
                   host_link_bytes_per_s=50e9, disk_bytes_per_s=7e9),
)}

# vLLM's default --gpu-memory-utilization is 0.9: the other 10% of HBM is left for
# activations, CUDA graphs, NCCL buffers and the allocator's slack.
ACTIVATION_RESERVE_SHARE = 0.10
# Host RAM the KV tier may take; the rest is the OS, the processes, page cache and pinned
# staging buffers (an assumption, stated: override with --host-tokens).
HOST_TIER_SHARE = 0.80


def kv_bytes_per_token_per_rank(model: ModelPreset, tp: int, attention_dp: bool = False) -> float:
    """One rank's KV bytes per token of the node's cache, on average. Under tensor
    parallelism every rank holds its shard of every token (all of it for MLA). With
    data-parallel attention (SGLang's --enable-dp-attention, how MLA models are served)
    each rank holds whole tokens of its own sequences: 1/tp of the tokens each."""
    kv = model.kv_bytes_per_token(tp)
    return kv / tp if attention_dp else kv


@dataclass(frozen=True)
class TierCapacities:
    tp: int
    kv_bytes_per_token: float  # one rank's, on average (kv_bytes_per_token_per_rank)
    weight_bytes_per_gpu: int
    device_tier_bytes_per_gpu: int  # HBM less weights and the reserve; < 0: does not fit
    device_tokens: int  # every rank holds its shard of every token: one rank's count
    host_tokens: int  # the node's RAM holds every rank's shard

    @property
    def fits(self) -> bool:
        return self.device_tokens > 0


def tier_capacities(model: ModelPreset, hw: HardwarePreset, tp: int | None = None,
                    reserve_share: float = ACTIVATION_RESERVE_SHARE,
                    host_share: float = HOST_TIER_SHARE,
                    attention_dp: bool = False) -> TierCapacities:
    tp = tp or hw.num_gpus
    kv = kv_bytes_per_token_per_rank(model, tp, attention_dp)
    weights = model.weight_bytes_per_gpu(tp)
    room = int(hw.hbm_bytes_per_gpu * (1 - reserve_share)) - weights
    host = int(hw.host_ram_bytes * host_share // (kv * tp))
    return TierCapacities(tp=tp, kv_bytes_per_token=kv, weight_bytes_per_gpu=weights,
                          device_tier_bytes_per_gpu=room,
                          device_tokens=max(0, int(room // kv)), host_tokens=host)


def model_from_config(path: str | Path) -> ModelPreset:
    """A preset from a checkpoint the engine serves, read by the engine's own loader (a
    directory holding config.json, or the config.json itself)."""
    from worker.model_config import load_model_config  # the engine's loader, torch-free

    p = Path(path)
    mc = load_model_config(p.parent if p.name == "config.json" else p)
    elem = 1 if "float8" in (mc.torch_dtype or "") else (4 if mc.torch_dtype == "float32" else 2)
    return ModelPreset(p.resolve().parent.name if p.name == "config.json" else p.name,
                       num_layers=mc.num_layers, hidden_size=mc.hidden_size,
                       num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                       head_dim=mc.head_dim, intermediate_size=mc.intermediate_size,
                       vocab_size=mc.vocab_size, tie_word_embeddings=mc.tie_word_embeddings,
                       weight_bytes_per_param=elem, kv_bytes_per_elem=elem)
