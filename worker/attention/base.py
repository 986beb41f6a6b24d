"""The attention backend interface: paged KV in, attention out.

Both backends take FlashInfer's CSR page table, so the model runner builds one
set of inputs for either:

- `qo_indptr[B+1]`: query tokens of sequence i are rows qo_indptr[i]:qo_indptr[i+1]
- `kv_indptr[B+1]`, `kv_indices`: its KV pages, in order
- `kv_last_page_len[B]`: tokens used in its last page, 1 <= last <= page_size

The page table is exact: a sequence with L tokens of context has
ceil(L / page_size) pages, never a spare one (a surplus page with a length taken
from the sequence reads stale KV once blocks are recycled). Causality is aligned
bottom-right: the last query row sees the whole context, cached prefix included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32, host
    kv_indptr: torch.Tensor  # [B+1] int32, host
    kv_indices: torch.Tensor  # [num_pages] int32, host
    kv_last_page_len: torch.Tensor  # [B] int32, host
    page_size: int

    @property
    def num_seqs(self) -> int:
        return self.qo_indptr.numel() - 1

    def kv_lens(self) -> torch.Tensor:
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (num_pages - 1) * self.page_size + self.kv_last_page_len

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token this step."""
        return self.qo_indptr[-1].item() == self.num_seqs


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for one step (host-side work shared by every layer)."""

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_qo_heads, head_dim]; k/v_cache: [num_pages, page_size,
        num_kv_heads, head_dim] (one layer, NHD); FP8 pages with their scales k/v_scale
        [num_pages, page_size, num_kv_heads] (worker/kv_quant.py). Returns [num_tokens,
        num_qo_heads, head_dim]. The new tokens' K/V are already in the cache."""
