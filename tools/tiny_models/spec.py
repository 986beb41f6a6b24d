"""The tiny model's shape (`TinySpec`, per architecture, with overrides) and its
deterministic random weights.

Every tensor comes from a torch.Generator seeded with the spec's seed, in a fixed order,
so the same spec gives byte-identical weights on every machine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Everything that determines the generated files (stored in the stamp)."""

    arch: str
    seed: int
    dtype: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Mixture of experts (qwen3_moe, mixtral); 0 experts: dense. Left out of the stamp when
    # dense, so the dense models' stamps (and files) are what they were before MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()  # qwen3_moe: layers with a dense MLP

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # head_dim 64 with hidden 256 / 8 heads: head_dim != hidden / heads, as in real Qwen3.
    "qwen3": dict(
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen2 has no head_dim in its config: it is always hidden / heads.
    "qwen2": dict(
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Shapes that split over 1, 2 and 4 ranks (heads, kv heads, every MLP width divisible
    # by 4): 8 experts, 2 per token; layer 1 dense, as `mlp_only_layers` allows.
    "qwen3_moe": dict(
        num_layers=4,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=256,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        mlp_only_layers=(1,),
    ),
    # Mixtral's experts are its MLP: intermediate_size is each expert's width.
    "mixtral": dict(
        num_layers=2,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=64,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
}

HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_spec(arch: str, seed: int, overrides: dict[str, Any]) -> TinySpec:
    """Arch defaults + overrides (None means "use the default"), validated."""
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_DEFAULTS)}")
    fields = {f.name for f in dataclasses.fields(TinySpec)} - {"arch", "seed"}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown model options: {sorted(unknown)}")
    values: dict[str, Any] = {"dtype": "bfloat16", **ARCH_DEFAULTS[arch]}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if arch == "qwen2" and overrides.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    if arch == "mixtral":  # one width: the experts are the MLP
        values["moe_intermediate_size"] = values["intermediate_size"]
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers", ()))
    spec = TinySpec(arch=arch, seed=int(seed), **values)
    _validate(spec)
    return spec


def _validate(spec: TinySpec) -> None:
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
    for name in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "max_position_embeddings",
    ):
        if getattr(spec, name) < 1:
            raise ValueError(f"{name} must be positive")
    if spec.num_experts and not 0 < spec.num_experts_per_tok <= spec.num_experts:
        raise ValueError("num_experts_per_tok must be in 1..num_experts")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if spec.head_dim % 2:
        raise ValueError("head_dim must be even (rotary embedding)")
    if spec.arch == "qwen2" and spec.head_dim * spec.num_heads != spec.hidden_size:
        # HF's Qwen2 derives head_dim from hidden / heads and ignores a head_dim key.
        raise ValueError("qwen2 requires head_dim == hidden_size / num_heads")
    # 256 byte symbols + the special tokens must fit, plus room for some merges.
    if spec.vocab_size < 512:
        raise ValueError("vocab_size must be at least 512")


# ---------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------

# Init scheme. The usual std=0.02 everywhere gives a model whose output barely depends
# on the context (uniform attention, layers adding little to the residual), so a broken
# KV cache or a wrong position would go unnoticed in tests. Instead every linear layer
# is scaled by 1/sqrt(fan_in) so each sublayer adds O(1) to the residual, q/k get a
# gain so attention scores have a std of ~QK_GAIN^2 (peaked, position-dependent
# attention), and the lm_head is scaled so logits have a std of ~LOGIT_STD (clear
# winners for greedy decoding, yet a non-degenerate distribution).
QK_GAIN = 1.5
LOGIT_STD = 3.0
UNTIED_EMBED_STD = 1.0
NORM_NOISE_STD = 0.05
BIAS_STD = 0.5


def _tensor_plan(spec: TinySpec) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """(HF name, shape, kind, std) for every tensor, in the fixed generation order."""
    h, d = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    embed_std = LOGIT_STD / math.sqrt(h) if spec.tie_word_embeddings else UNTIED_EMBED_STD

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0):
        return (name, (out_f, in_f), "normal", gain / math.sqrt(in_f))

    yield ("model.embed_tokens.weight", (spec.vocab_size, h), "normal", embed_std)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        yield (f"{p}.input_layernorm.weight", (h,), "norm", NORM_NOISE_STD)
        yield linear(f"{p}.self_attn.q_proj.weight", q_out, h, QK_GAIN)
        yield linear(f"{p}.self_attn.k_proj.weight", kv_out, h, QK_GAIN)
        yield linear(f"{p}.self_attn.v_proj.weight", kv_out, h)
        if spec.qkv_bias:
            yield (f"{p}.self_attn.q_proj.bias", (q_out,), "normal", BIAS_STD)
            yield (f"{p}.self_attn.k_proj.bias", (kv_out,), "normal", BIAS_STD)
            yield (f"{p}.self_attn.v_proj.bias", (kv_out,), "normal", BIAS_STD)
        if spec.qk_norm:
            yield (f"{p}.self_attn.q_norm.weight", (d,), "norm", NORM_NOISE_STD)
            yield (f"{p}.self_attn.k_norm.weight", (d,), "norm", NORM_NOISE_STD)
        yield linear(f"{p}.self_attn.o_proj.weight", h, q_out)
        yield (f"{p}.post_attention_layernorm.weight", (h,), "norm", NORM_NOISE_STD)
        if spec.is_moe_layer(i):
            yield from _moe_plan(spec, i)
            continue
        yield linear(f"{p}.mlp.gate_proj.weight", spec.intermediate_size, h)
        yield linear(f"{p}.mlp.up_proj.weight", spec.intermediate_size, h)
        yield linear(f"{p}.mlp.down_proj.weight", h, spec.intermediate_size)
    yield ("model.norm.weight", (h,), "norm", NORM_NOISE_STD)
    if not spec.tie_word_embeddings:
        yield linear("lm_head.weight", spec.vocab_size, h, LOGIT_STD)


def _moe_plan(spec: TinySpec, i: int) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    # The router at unit gain: logits of std ~1 over 8 experts route tokens to varied
    # experts with clear top-k choices, so a wrong routing shows in the logits.
    h, m = spec.hidden_size, spec.moe_intermediate_size
    if spec.arch == "mixtral":
        p, gate, up, down = f"model.layers.{i}.block_sparse_moe", "w1", "w3", "w2"
    else:
        p, gate, up, down = f"model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"
    yield (f"{p}.gate.weight", (spec.num_experts, h), "normal", 1 / math.sqrt(h))
    for e in range(spec.num_experts):
        yield (f"{p}.experts.{e}.{gate}.weight", (m, h), "normal", 1 / math.sqrt(h))
        yield (f"{p}.experts.{e}.{up}.weight", (m, h), "normal", 1 / math.sqrt(h))
        yield (f"{p}.experts.{e}.{down}.weight", (h, m), "normal", 1 / math.sqrt(m))


def make_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """All tensors from one CPU generator, in a fixed order: same spec, same bytes."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind, std in _tensor_plan(spec):
        # Always sample in float32, then cast: the stream of random numbers must not
        # depend on the output dtype.
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if kind == "norm":
            t += 1.0
        tensors[name] = t.to(dtype).contiguous()
    return tensors
