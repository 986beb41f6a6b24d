"""The model's architecture, read from a Hugging Face `config.json`.

The Llama family is served: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 dense
(per-head q/k RMSNorm, explicit head_dim), the mixture-of-experts Qwen3-MoE and
Mixtral (worker/moe.py), and the hybrids Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet
linear-attention layers beside gated full-attention ones: worker/hybrid_model.py); rope
scalings linear, llama3, yarn and dynamic NTK (worker/rope.py). Anything else is refused
here, at load, with a clear message rather than producing wrong logits later. Keys are
read as transformers reads them, under either name of its `attribute_map` aliases
(`with_aliases`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from worker.rope import ROPE_TYPES, rope_frequencies, rope_type

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    # the multimodal wrappers: their `text_config` is the text model served
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# a wrapper's family -> the architecture of the text model inside it
TEXT_MODEL_OF = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
SUPPORTED_ROPE_TYPES = ROPE_TYPES
# transformers' `attribute_map` of each family's config class, {alias: the name stored}: a
# config.json may hold an attribute under either name. transformers 5 saves Qwen3-MoE's
# expert count as `num_local_experts`, where 4.x saved `num_experts`. A table, not an
# import: transformers is a dev dependency, and importing its config registry cost each rank
# ~0.7 s and 23 MB at start; tests/worker/test_hf_saved_moe.py holds the table equal to the
# installed transformers' maps.
ATTRIBUTE_MAPS = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "mixtral": {"num_experts": "num_local_experts"},
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Mixture of experts (0 experts: a dense model). Each MoE layer routes every token to
    # `num_experts_per_tok` experts of width `moe_intermediate_size`; the layers in
    # `moe_layers` are MoE, the others a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Qwen3-Next / Qwen3.5-MoE: a dense expert every token goes through, its output scaled
    # by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    # A hybrid model (worker/hybrid_model.py): each layer's kind (LINEAR_ATTENTION or
    # FULL_ATTENTION; empty: every layer attends), the Gated DeltaNet layers' heads and
    # causal-conv width, the rotated share of each attention head's dims and whether the
    # attention output is gated (q_proj also yields a sigmoid gate per head).
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over the KV cache (every layer of a non-hybrid model)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers, which keep a recurrent state instead of KV."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the cache holds: only the attention layers."""
        return len(self.attention_layers)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head the rotary turns (partial rotary: the rest pass)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def check_tensor_parallel(self, world_size: int) -> None:
        """Refuse a split that does not divide evenly (heads and MLP columns per rank)."""
        for name, count in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ):
            if count % world_size:
                raise UnsupportedModelError(
                    f"{name}={count} does not divide by world size {world_size}: "
                    f"choose a world size that divides it"
                )

    def kv_bytes_per_token(self, world_size: int, elem_size: int) -> int:
        """KV bytes one rank stores per token (K and V, every attention layer, its heads)."""
        heads = self.num_kv_heads // world_size
        return 2 * self.num_kv_layers * heads * self.head_dim * elem_size

    def rope(self) -> tuple[list[float], float]:
        """(rotary inverse frequencies, attention scaling of cos/sin), scaling applied."""
        return rope_frequencies(self.rotary_dim, self.rope_theta, self.rope_scaling,
                                self.max_position_embeddings)

    def inv_freq(self) -> list[float]:
        return self.rope()[0]

    @property
    def max_context(self) -> int:
        """The longest context the model serves: max_position_embeddings, stretched by the
        rope scaling's factor where the config states the original length instead (as
        vLLM derives it): yarn over original_max_position_embeddings, linear and dynamic
        over max_position_embeddings; llama3 configs already state the extended length."""
        s, kind = self.rope_scaling or {}, rope_type(self.rope_scaling)
        if kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * s["factor"])
        if kind == "yarn" and s.get("factor"):
            original = s.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * s["factor"]))
        return self.max_position_embeddings

    @property
    def dynamic_rope(self) -> tuple[int, float, float, int] | None:
        """(head_dim, theta, factor, original length) under dynamic NTK scaling, else None."""
        if rope_type(self.rope_scaling) != "dynamic":
            return None
        return (self.rotary_dim, self.rope_theta, float(self.rope_scaling["factor"]),
                self.max_position_embeddings)


def attribute_map(family: str) -> dict[str, str]:
    """{alias: stored name} for a family (a model_type), as its transformers config class
    maps them (the table above; a test holds it equal to the installed transformers')."""
    return ATTRIBUTE_MAPS.get(family, {})


def with_aliases(raw: dict, family: str) -> dict:
    """config.json as transformers reads it: each attribute under both of its names, from
    whichever the file holds (the stored name where it holds both)."""
    out = dict(raw)
    for alias, stored in attribute_map(family).items():
        if stored in raw:
            out[alias] = raw[stored]
        elif alias in raw:
            out[stored] = raw[alias]
    return out


def _moe_fields(raw: dict, family: str) -> dict:
    """The MoE part of a config.json, as transformers reads it."""
    if family == "mixtral":  # every layer sparse; top-k renormalised; experts are the MLP
        n = raw.get("num_local_experts", 8)
        return dict(num_experts=n, num_experts_per_tok=raw.get("num_experts_per_tok", 2),
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(range(raw["num_hidden_layers"])))
    if family in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next"):
        if family == "qwen3_moe" and raw.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("a shared expert is not supported (Qwen3-MoE has none)")
        n, step = raw.get("num_experts", 128), raw.get("decoder_sparse_step", 1)
        dense = set(raw.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(raw["num_hidden_layers"])
                       if i not in dense and n > 0 and (i + 1) % step == 0)
        return dict(num_experts=n, num_experts_per_tok=raw.get("num_experts_per_tok", 8),
                    moe_intermediate_size=raw.get("moe_intermediate_size", 768),
                    # Qwen3.5-MoE's router always renormalises (its config has no such key)
                    norm_topk_prob=bool(raw.get("norm_topk_prob", family != "qwen3_moe")),
                    moe_layers=layers,
                    shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size")
                    or 0)
    return {}


def _hybrid_fields(raw: dict, rope: dict, family: str) -> dict:
    """The linear-attention part of a hybrid's config.json, as transformers reads it."""
    if family not in HYBRID_FAMILIES:
        return {}
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or [  # transformers' default: every 4th layer attends
        FULL_ATTENTION if (i + 1) % raw.get("full_attention_interval", 4) == 0
        else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise UnsupportedModelError(f"layer_types {types!r}: expected {n} of "
                                    f"{LINEAR_ATTENTION!r} / {FULL_ATTENTION!r}")
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    return dict(
        layer_types=tuple(types),
        linear_num_key_heads=raw.get("linear_num_key_heads", 16),
        linear_num_value_heads=raw.get("linear_num_value_heads", 32),
        linear_key_head_dim=raw.get("linear_key_head_dim", 128),
        linear_value_head_dim=raw.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(factor),
        attn_output_gate=True,
    )


def _text_config(raw: dict, family: str) -> tuple[dict, str]:
    """A multimodal wrapper's text model (its `text_config`, with what the wrapper states
    for all of it), else the config itself; and the family read."""
    if family not in TEXT_MODEL_OF:
        return raw, family
    text = dict(raw.get("text_config") or {})
    if not text:
        raise UnsupportedModelError(f"{family}: config.json has no text_config")
    for key in ("tie_word_embeddings", "eos_token_id", "torch_dtype", "dtype"):
        if key not in text and key in raw:
            text[key] = raw[key]
    arch = TEXT_MODEL_OF[family]
    return text, SUPPORTED_ARCHITECTURES[arch]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face checkpoint dir")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"DeepInfer serves {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    raw, family = _text_config(raw, SUPPORTED_ARCHITECTURES[arch])
    arch = TEXT_MODEL_OF.get(SUPPORTED_ARCHITECTURES[arch], arch)
    raw = with_aliases(raw, family)
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (silu)")

    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    # transformers 5 moved rope_theta and rope_scaling into `rope_parameters`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rope_type(rope)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )

    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    attention_bias = bool(raw.get("attention_bias", False))
    if attention_bias and family in HYBRID_FAMILIES:
        raise UnsupportedModelError(f"{arch}: attention_bias=true is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope_theta=rope_theta,
        rope_scaling=rope if kind != "default" else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral") and attention_bias,
        qk_norm=family in ("qwen3", "qwen3_moe", *HYBRID_FAMILIES),
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        **_moe_fields(raw, family),
        **_hybrid_fields(raw, rope, family),
    )
