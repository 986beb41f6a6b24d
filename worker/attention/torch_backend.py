"""Paged attention in plain torch: the CPU backend and the reference for FlashInfer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata


class TorchAttentionBackend:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._seqs: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]] = []

    def plan(self, meta: AttentionMetadata) -> None:
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        kv_lens = meta.kv_lens().tolist()
        indices = meta.kv_indices.to(self.device, torch.long)
        self._seqs = []
        for i in range(meta.num_seqs):
            q_len, kv_len = qo[i + 1] - qo[i], kv_lens[i]
            assert 0 < q_len <= kv_len, f"seq {i}: {q_len} queries over {kv_len} keys"
            pages = indices[kv[i] : kv[i + 1]]
            mask = _causal_mask(q_len, kv_len, self.device)
            self._seqs.append((qo[i], q_len, pages, kv_len, mask))

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, q_len, pages, kv_len, mask in self._seqs:
            qs = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            k = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)  # [Hkv, kv_len, D]
            v = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1, enable_gqa=True
            )
            out[start : start + q_len] = o.transpose(0, 1)
        return out


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right causal mask: query row j sits at position kv_len - q_len + j.

    SDPA's `is_causal` aligns top-left, which is only right when q_len == kv_len
    (no cached prefix), so any other prefill gets an explicit mask.
    """
    if q_len == 1 or q_len == kv_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    # [q_len, kv_len] bool, True = attend
    return torch.arange(kv_len, device=device)[None, :] <= rows
