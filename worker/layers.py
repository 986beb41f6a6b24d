"""Building blocks of a tensor-parallel Llama layer: norms, rotary, sharded projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.distributed import TensorParallelGroup
from worker.linear import Linear
from worker.rope import dynamic_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 and cast back before the weight, as HF does, so
    # bf16 results round the same way as the reference.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class Rotary:
    """Rotary position embedding (HF's rotate-half layout).

    `scaling` multiplies cos and sin (YaRN's attention factor). With `dynamic` (dynamic
    NTK: head_dim, theta, factor, original length) the frequencies are per token, from
    the length its sequence has at the end of this step's chunk: a prompt prefilled in
    one chunk gets HF's frequencies for that length at every position, and each decode
    step those of its new length, while the keys already cached keep the rotation they
    were written with, which is what HF's `generate` with its KV cache does too. Two
    consequences, as in HF fed the same pieces: a prompt prefilled in several chunks gets
    each chunk's own length, and keys reused from the prefix cache keep the rotation of
    the sequence that wrote them (tests/worker/test_moe_reference.py checks one chunk).
    """

    def __init__(self, inv_freq: list[float], device: torch.device, scaling: float = 1.0,
                 dynamic: tuple[int, float, float, int] | None = None) -> None:
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
        self.scaling = scaling
        self.dynamic = dynamic

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if self.dynamic is not None:
            lens = positions + 1 if seq_lens is None else seq_lens
            freqs = positions.float()[:, None] * dynamic_inv_freq(*self.dynamic, lens)
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, bit for bit (a + (-b) * s is a - b * s in IEEE
        arithmetic), without building rotate_half(x): two passes over half of x fewer.
        x: [T, H, D]; cos, sin: [T, 1, D]."""
        half = x.shape[-1] // 2
        out = x * cos  # [T, H, D]
        out[..., :half] -= x[..., half:] * sin[..., :half]
        out[..., half:] += x[..., :half] * sin[..., half:]
        return out


class VocabParallelEmbedding:
    """Each rank holds rows [start, end) of the vocabulary; lookups are summed across ranks."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int, tp: TensorParallelGroup):
        self.weight = weight  # [rows on this rank, hidden]
        self.start = start
        self.end = start + weight.shape[0]
        self.vocab_size = vocab_size
        self.tp = tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead:
    """Vocab-parallel output projection; rank 0 receives the full logits, or with
    `everywhere` every rank does."""

    def __init__(self, weight: torch.Tensor, rows_per_rank: int, vocab_size: int,
                 tp: TensorParallelGroup, linear: Linear, everywhere: bool = False):
        self.weight = weight  # [rows on this rank, hidden]
        self.linear = linear
        self.rows_per_rank = rows_per_rank
        self.vocab_size = vocab_size
        self.tp = tp
        self.everywhere = everywhere

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.linear(hidden, self.weight)  # [B, rows on this rank]
        pad = self.rows_per_rank - logits.shape[-1]
        if pad:  # the last rank's shard may be short; gather needs equal sizes
            logits = F.pad(logits, (0, pad))
        full = self.tp.gather_last_dim(logits, self.everywhere)
        return None if full is None else full[..., : self.vocab_size]
