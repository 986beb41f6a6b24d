"""Tiny hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: three Gated DeltaNet layers,
then one gated full-attention layer), written by the installed transformers.

Unlike the Llama-family tiny models (spec.py writes their tensors itself), these come
from transformers' own model classes and `save_pretrained`, so their names, layouts and
config.json are what transformers writes; only the values are ours: every parameter
redrawn from a torch.Generator seeded with the spec's seed, in name order, at scales that
make each layer matter (spec.py's scheme: unit-gain projections, peaked attention, clear
greedy winners; decays that keep the recurrent state for a few tokens). transformers is
a dev dependency, needed here only.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from tools.tiny_models.spec import LOGIT_STD, NORM_NOISE_STD, QK_GAIN, UNTIED_EMBED_STD

HYBRID_ARCHS = {  # --arch -> (transformers config class, its extra fields)
    "qwen3_5": ("Qwen3_5TextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=128)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=64,
                                           shared_expert_intermediate_size=128,
                                           norm_topk_prob=True, decoder_sparse_step=1,
                                           mlp_only_layers=[1])),
}


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """Shapes that split over 1, 2 and 4 ranks: attention and linear heads, every width."""

    arch: str
    seed: int
    dtype: str = "bfloat16"
    vocab_size: int = 8192
    hidden_size: int = 128
    num_layers: int = 4  # linear, linear, linear, full
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    intermediate_size: int = 256
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192


def hf_config(spec: HybridSpec, ids: dict[str, int]):
    import transformers

    class_name, extra = HYBRID_ARCHS[spec.arch]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "partial_rotary_factor": spec.partial_rotary_factor}
    if spec.arch.startswith("qwen3_5"):  # as the published checkpoints: interleaved M-RoPE
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    return getattr(transformers, class_name)(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        layer_types=["linear_attention"] * (spec.num_layers - 1) + ["full_attention"],
        rope_parameters=rope, rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"), pad_token_id=ids.get("pad"),
        **extra)


def _value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A parameter's random value by its role (the module docstring's scales)."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    leaf = name.rsplit(".", 2)[-2:]
    if name.endswith("embed_tokens.weight"):
        return noise * UNTIED_EMBED_STD
    if name.endswith("A_log"):  # decay rates exp(A_log) in [0.05, 1): a state kept a while
        return (torch.rand(shape, generator=gen) * 0.95 + 0.05).log()
    if name.endswith("dt_bias"):
        return noise * 0.5
    if name.endswith("linear_attn.norm.weight"):  # a plain RMSNorm: 1 + noise
        return 1.0 + noise * NORM_NOISE_STD
    if len(shape) == 1:  # Gemma-style norms, x * (1 + w): w is the noise
        return noise * NORM_NOISE_STD
    gain = QK_GAIN if leaf[0] in ("q_proj", "k_proj") else 1.0
    if name == "lm_head.weight":
        gain = LOGIT_STD
    return noise * gain / math.sqrt(shape[-1])  # unit gain over the fan-in


def write_hybrid(spec: HybridSpec, out_dir: Path, ids: dict[str, int]) -> int:
    """Build the model from transformers' class, redraw every parameter, save it with
    save_pretrained. Returns the number of parameters."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec, ids))
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            params[name].copy_(_value(name, params[name].shape, gen))
    model.to(getattr(torch, spec.dtype)).save_pretrained(out_dir)
    return sum(p.numel() for p in params.values())
