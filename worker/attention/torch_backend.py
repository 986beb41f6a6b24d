"""Paged attention in plain torch: the CPU backend and the reference for FlashInfer.

Every call goes to SDPA's fused (flash) kernel, never its math fallback, which
builds the whole score matrix: on CPU that takes 4-D inputs, no `enable_gqa` and
either `is_causal` or a mask that broadcasts over the heads. So:

- decodes (one query each) of every sequence of the step run as one call: their
  pages gathered once into a padded [B, Hkv, L, D] view, the G query heads of a KV
  head folded into the query rows ([B, Hkv, G, D]: one query per row needs no
  causal mask, only a [B, 1, 1, L] padding mask);
- each prefill runs on its own, its K/V repeated to the query heads; with no
  cached prefix it is `is_causal`, with one a [q_len, kv_len] bottom-right mask.

All the step's index tensors and masks are built once in `plan()`, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata


@dataclass
class _Pages:
    """Where one sequence's KV lives: a slice when its pages are consecutive ids (no
    copy), else an index to gather."""

    first: int
    count: int
    index: torch.Tensor | None  # [count] long, None when consecutive

    def take(self, cache: torch.Tensor) -> torch.Tensor:
        # cache: [num_pages, page, Hkv, D] -> [count, page, Hkv, D]
        if self.index is None:
            return cache[self.first : self.first + self.count]
        return cache[self.index]


@dataclass
class _Prefill:
    start: int  # first query row
    q_len: int
    kv_len: int
    pages: _Pages
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend); None: is_causal


@dataclass
class _Decode:
    num: int  # B, the decoding sequences
    rows: torch.Tensor | None  # [B] long query rows; None when they are 0..B-1
    pages: _Pages | None  # one sequence: its pages (maybe a slice)
    page_index: torch.Tensor | None  # [B, P] long, padded with page 0 (masked out)
    kv_len: int  # the longest context, the padded length L is P * page_size
    mask: torch.Tensor | None  # [B, 1, 1, L] bool; None when nothing is padding


def _pages(indices: list[int], device: torch.device) -> _Pages:
    first, n = indices[0], len(indices)
    if indices == list(range(first, first + n)):
        return _Pages(first, n, None)
    return _Pages(first, n, torch.tensor(indices, dtype=torch.long, device=device))


class TorchAttentionBackend:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_qo_heads // num_kv_heads
        self._prefills: list[_Prefill] = []
        self._decode: _Decode | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        kv_lens = meta.kv_lens().tolist()
        indices = meta.kv_indices.tolist()
        page = meta.page_size
        self._prefills = []
        decodes: list[int] = []
        for i in range(meta.num_seqs):
            q_len, kv_len = qo[i + 1] - qo[i], kv_lens[i]
            assert 0 < q_len <= kv_len, f"seq {i}: {q_len} queries over {kv_len} keys"
            if q_len == 1:
                decodes.append(i)
                continue
            self._prefills.append(_Prefill(
                qo[i], q_len, kv_len, _pages(indices[kv[i] : kv[i + 1]], self.device),
                _causal_mask(q_len, kv_len, self.device)))
        self._decode = self._plan_decode(decodes, qo, kv, kv_lens, indices, page)

    def _plan_decode(self, seqs: list[int], qo: list[int], kv: list[int], kv_lens: list[int],
                     indices: list[int], page: int) -> _Decode | None:
        if not seqs:
            return None
        rows = [qo[i] for i in seqs]
        row_index = (None if rows == list(range(len(rows)))
                     else torch.tensor(rows, dtype=torch.long, device=self.device))
        lens = [kv_lens[i] for i in seqs]
        if len(seqs) == 1:
            i = seqs[0]
            return _Decode(1, row_index, _pages(indices[kv[i] : kv[i + 1]], self.device), None,
                           lens[0], None)
        num_pages = max(kv[i + 1] - kv[i] for i in seqs)
        table = torch.zeros(len(seqs), num_pages, dtype=torch.long)  # page 0 pads
        for b, i in enumerate(seqs):
            table[b, : kv[i + 1] - kv[i]] = torch.tensor(indices[kv[i] : kv[i + 1]])
        padded = num_pages * page
        mask = None
        if any(n != padded for n in lens):
            ctx = torch.tensor(lens)[:, None, None, None]  # [B, 1, 1, 1]
            mask = (torch.arange(padded)[None, None, None, :] < ctx).to(self.device)
        return _Decode(len(seqs), row_index, None, table.to(self.device), max(lens), mask)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        d = self._decode
        if d is not None and not self._prefills and d.rows is None:
            return self._run_decode(q, k_cache, v_cache)  # a pure decode step: no scatter
        out = torch.empty_like(q)
        for p in self._prefills:
            out[p.start : p.start + p.q_len] = self._run_prefill(p, q, k_cache, v_cache)
        if d is not None:
            if d.rows is None:  # the decodes come first
                out[: d.num] = self._run_decode(q[: d.num], k_cache, v_cache)
            else:
                out[d.rows] = self._run_decode(q[d.rows], k_cache, v_cache)
        return out

    def _run_prefill(self, p: _Prefill, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> torch.Tensor:
        qs = q[p.start : p.start + p.q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = self._heads(p.pages.take(k_cache).flatten(0, 1)[: p.kv_len])  # [1, H, kv_len, D]
        v = self._heads(p.pages.take(v_cache).flatten(0, 1)[: p.kv_len])
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=p.mask, is_causal=p.mask is None)
        return o[0].transpose(0, 1)  # [q_len, H, D]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, D] -> [1, H, L, D]: each KV head repeated for its G query heads (a
        copy when G > 1: the fused kernel takes no grouped heads)."""
        x = x.transpose(0, 1)  # [Hkv, L, D]
        if self.group > 1:
            hkv, length, d = x.shape
            x = x[:, None].expand(hkv, self.group, length, d).reshape(-1, length, d)
        return x[None]

    def _run_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor) -> torch.Tensor:
        """q: [B, H, D], one query per sequence -> [B, H, D]."""
        d = self._decode
        assert d is not None
        b, h, dim = q.shape
        if d.pages is not None:  # one sequence
            k = d.pages.take(k_cache).flatten(0, 1)[None, : d.kv_len]  # [1, L, Hkv, D]
            v = d.pages.take(v_cache).flatten(0, 1)[None, : d.kv_len]
        else:
            k = k_cache[d.page_index].flatten(1, 2)  # [B, P * page, Hkv, D]
            v = v_cache[d.page_index].flatten(1, 2)
        qg = q.view(b, self.num_kv_heads, self.group, dim)  # [B, Hkv, G, D]: head h -> h // G
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=d.mask)  # [B, Hkv, G, D]
        return o.reshape(b, h, dim)


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right causal mask: query row j sits at position kv_len - q_len + j.

    SDPA's `is_causal` aligns top-left, which is only right when q_len == kv_len
    (no cached prefix), so any other prefill gets an explicit mask, [q_len, kv_len],
    broadcast over the heads by the fused kernel.
    """
    if q_len == kv_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    # [q_len, kv_len] bool, True = attend
    return torch.arange(kv_len, device=device)[None, :] <= rows
