"""Token sampling on rank 0: greedy at temperature 0, else temperature/top-k/top-p.

A seeded request draws from a generator keyed by (seed, position), so its
tokens do not depend on what else was in the batch or on the step it ran in.
A guided request's row first loses the tokens its grammar excludes (the bitmask the
scheduler sent with the chunk: scheduler/guided.py).
"""

from __future__ import annotations

import numpy as np
import torch

from wire.client import MIN_TEMPERATURE, SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int], allowed: list[bytes | None] | None = None) -> list[int]:
    """logits: [B, vocab] float32, masked in place where `allowed` has a bitmask.
    Returns one token id per row."""
    return sample_tensor(logits, params, seeds, positions, allowed).tolist()


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  positions: list[int], allowed: list[bytes | None] | None = None
                  ) -> torch.Tensor:
    """`sample`, the tokens left on the logits' device: on a GPU nothing here waits for
    the forward pass, so the rank prepares its next step while the device still runs
    (worker/forward.py); reading the tokens is the one wait."""
    if allowed:
        _mask_disallowed(logits, allowed)
    tokens = logits.argmax(dim=-1)
    for row, p in enumerate(params):
        if p.temperature >= MIN_TEMPERATURE:  # below it: greedy, whoever sent it
            tokens[row] = _sample_row(logits[row], p, seeds[row], positions[row])
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, seed: int,
                position: int) -> torch.Tensor:
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
    return torch.multinomial(probs, 1, generator=gen)[0]


def _mask_disallowed(logits: torch.Tensor, allowed: list[bytes | None]) -> None:
    """Set to -inf the logits of tokens each row's bitmask excludes (bit i of little-endian
    32-bit words: token i, so the bytes read least significant bit first). The masks are
    unpacked on the host and sent in one copy: no per-row device sync."""
    rows = [row for row, mask in enumerate(allowed) if mask is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    width = -(-vocab // 8)
    packed = np.zeros((len(rows), width), dtype=np.uint8)  # a short mask excludes the rest
    for i, row in enumerate(rows):  # views: llguidance may pad a mask by a word
        mask = np.frombuffer(allowed[row], dtype=np.uint8)[:width]
        packed[i, :len(mask)] = mask
    keep = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].astype(bool)
    # nothing allowed: a broken grammar. Sampling -inf everywhere would fail the whole
    # step; sampled unmasked, the scheduler sees the grammar refuse the token and ends
    # only this request with an error.
    keep[~keep.any(axis=1)] = True
    index = torch.tensor(rows, device=logits.device)
    keep_t = torch.from_numpy(keep).to(logits.device)
    logits[index] = logits[index].masked_fill(~keep_t, float("-inf"))
