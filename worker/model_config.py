"""The model's architecture, read from a Hugging Face `config.json`.

Only the Llama family is served: Llama 2/3 (llama3 rope scaling included),
Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 dense (per-head q/k RMSNorm, explicit
head_dim). Anything else is refused here, at load, with a clear message rather
than producing wrong logits later.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    def check_tensor_parallel(self, world_size: int) -> None:
        """Refuse a split that does not divide evenly (heads and MLP columns per rank)."""
        for name, count in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if count % world_size:
                raise UnsupportedModelError(
                    f"{name}={count} does not divide by world size {world_size}: "
                    f"choose a world size that divides it"
                )

    def kv_bytes_per_token(self, world_size: int, elem_size: int) -> int:
        """KV bytes one rank stores per token (K and V, every layer, its heads)."""
        return 2 * self.num_layers * (self.num_kv_heads // world_size) * self.head_dim * elem_size

    def inv_freq(self) -> list[float]:
        """Rotary inverse frequencies, with llama3/linear scaling applied."""
        d = self.head_dim
        base = [1.0 / (self.rope_theta ** (i / d)) for i in range(0, d, 2)]
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            return [f / scaling["factor"] for f in base]
        if kind == "llama3":
            return _llama3_inv_freq(base, scaling)
        return base


def _llama3_inv_freq(base: list[float], s: dict) -> list[float]:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


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
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (silu)")

    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    # transformers 5 moved rope_theta and rope_scaling into `rope_parameters`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )

    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    attention_bias = bool(raw.get("attention_bias", False))
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
        rope_scaling=rope if rope_type != "default" else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family in ("llama", "mistral", "qwen3") and attention_bias,
        qk_norm=family == "qwen3",
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
    )
