"""Rotary frequencies for every rope scaling served, computed as transformers'
`modeling_rope_utils` computes them (default, linear, llama3, yarn, dynamic NTK).

`rope_frequencies` gives the inverse frequencies and the attention scaling that multiplies
cos and sin (YaRN's mscale; 1 for the others). Dynamic NTK is the one scaling whose
frequencies depend on the sequence: `dynamic_inv_freq` gives them per token, from the
length of the token's sequence at the end of its step's chunk (see `Rotary` in layers.py
for what that means against HF).
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_type(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None,
                     max_position_embeddings: int) -> tuple[list[float], float]:
    """(inverse frequencies [head_dim / 2], attention scaling of cos/sin)."""
    d = head_dim
    base = [1.0 / (theta ** (i / d)) for i in range(0, d, 2)]
    kind = rope_type(scaling)
    if kind == "linear":
        return [f / scaling["factor"] for f in base], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    # dynamic: at or below the original length the frequencies are the default ones
    return base, 1.0


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict, max_pos: int) -> tuple[list[float], float]:
    # YaRN: dimensions that rotate many times over the original context keep their
    # frequency (extrapolation), those that rotate less than once are divided by
    # `factor` (interpolation), with a linear ramp between beta_fast and beta_slow
    # rotations; cos/sin are scaled by the attention factor. float32 as HF computes it.
    original = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of the unscaled frequency, per dimension
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq.tolist(), float(attention)


def dynamic_inv_freq(head_dim: int, theta: float, factor: float, max_position_embeddings: int,
                     seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK inverse frequencies per token: [T] sequence lengths -> [T, head_dim / 2].

    HF's base grows with the sequence once it passes max_position_embeddings:
    theta * (factor * L / max - (factor - 1)) ** (d / (d - 2)); below it, theta.
    """
    d = head_dim
    length = seq_lens.float().clamp(min=max_position_embeddings)[:, None]  # [T, 1]
    base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
    exponent = torch.arange(0, d, 2, dtype=torch.float32, device=seq_lens.device) / d
    return 1.0 / (base ** exponent[None, :])  # [T, D/2]
