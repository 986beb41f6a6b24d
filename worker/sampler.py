"""Token sampling on rank 0: greedy at temperature 0, else temperature/top-k/top-p.

A seeded request draws from a generator keyed by (seed, position), so its
tokens do not depend on what else was in the batch or on the step it ran in.
"""

from __future__ import annotations

import torch

from scheduler.protocol import MIN_TEMPERATURE, SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> list[int]:
    """logits: [B, vocab] float32. Returns one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.temperature >= MIN_TEMPERATURE:  # below it: greedy, whoever sent it
            tokens[row] = _sample_row(logits[row], p, seeds[row], positions[row])
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> int:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 (5e-324) must not drop it
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator(device=logits.device)
    gen.manual_seed((seed * _SEED_MIX + position) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=gen).item())
