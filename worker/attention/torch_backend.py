"""Paged attention in plain torch: the CPU backend and the reference for FlashInfer.

Every call goes to SDPA's fused (flash) kernel, never its math fallback, which
builds the whole score matrix: on CPU that takes 4-D inputs, no `enable_gqa` and
either `is_causal` or a mask that broadcasts over the heads. So:

- decodes (one query each) of every sequence of the step run as one call: their
  pages gathered once into a padded [B, Hkv, L, D] view, the G query heads of a KV
  head folded into the query rows ([B, Hkv, G, D]: one query per row needs no
  causal mask, only a [B, 1, 1, L] padding mask);
- each prefill runs on its own: with no cached prefix `is_causal`, its K/V repeated
  to the query heads; behind one, two calls without a mask (over the prefix, then
  causal over its own keys) merged by their log-sum-exps, the G query heads of a KV
  head folded into the query rows as for decodes (no K/V copy).

- a short chunk behind a prefix (a drafted decode of speculative decoding: the last
  token and its drafts) runs as that many decodes, query row j over the first
  kv_len - q_len + 1 + j keys, which is its causal mask: the decode path's cost per row
  instead of a gather of every page and a prefill's two calls.

All the step's index tensors and masks are built once in `plan()`, not per layer.

Where the compiled CPU kernels are there (`cpu_kernels`, on CPU tensors), the step
skips the gathers and SDPA instead: `paged_decode` takes the decodes (and short chunks
behind a prefix), `paged_prefill` every other chunk (head dims 32, 64, 128), each reading
the pages in place and writing its sequences' rows of the output; in bfloat16 the
prefill kernel's dot products run at about twice SDPA's rate where the CPU has AVX512_BF16
and no AMX. Each kernel is used where the rank's kernel choice found it faster on this
machine (worker/kernel_choice.py: `prefill_kernel`, `decode_kernel`), the other path runs
in torch in the same step. The plain-torch paths stay the reference the kernels are
tested against.

FP8 KV (worker/kv_quant.py) comes with its scales: the kernels read it back as they read
each row; the torch paths read back the pages they gather, into q's dtype, and attend
over those as over any KV.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata
from worker.cpu_kernels import PREFILL_KERNEL_HEAD_DIMS
from worker.kv_quant import dequantize


@dataclass
class _Pages:
    """Where one sequence's KV lives: a slice when its pages are consecutive ids (no
    copy), else an index to gather."""

    first: int
    count: int
    index: torch.Tensor | None  # [count] long, None when consecutive

    def take(self, cache: torch.Tensor) -> torch.Tensor:
        # cache: [num_pages, page, Hkv, D] -> [count, page, Hkv, D] (or scales, no D)
        if self.index is None:
            return cache[self.first : self.first + self.count]
        return cache.index_select(0, self.index)  # a page-sized memcpy each, unlike cache[index]


@dataclass
class _Layer:
    """One layer's pages as a forward call gets them: K and V, and their scales (FP8)."""

    k: torch.Tensor  # [num_pages, page, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [num_pages, page, Hkv] float32, FP8 only
    v_scale: torch.Tensor | None

    def read(self, take: Callable[[torch.Tensor], torch.Tensor],
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages `take` picks from a [num_pages, ...] tensor, in `dtype`
        (FP8 read back with its scales)."""
        if self.k_scale is None:
            return take(self.k), take(self.v)
        return (dequantize(take(self.k), take(self.k_scale), dtype),
                dequantize(take(self.v), take(self.v_scale), dtype))


@dataclass
class _Prefill:
    start: int  # first query row
    q_len: int
    kv_len: int
    pages: _Pages


@dataclass
class _Decode:
    num: int  # B, the decoding sequences
    rows: torch.Tensor | None  # [B] long query rows; None when they are 0..B-1
    pages: _Pages | None  # one sequence: its pages (maybe a slice)
    page_index: torch.Tensor | None  # [B, P] long, padded with page 0 (masked out)
    kv_len: int  # the longest context, the padded length L is P * page_size
    mask: torch.Tensor | None  # [B, 1, 1, L] bool; None when nothing is padding


@dataclass
class _KernelBatch:
    """A compiled kernel's inputs for some of the step's sequences. paged_decode: the
    decodes, each with its first query row and query count (1, or the rows of a short
    chunk behind a prefix: a speculative verify), read together over one pass of its
    pages. paged_prefill: the prefill chunks, cached prefix or not."""

    rows: torch.Tensor  # [B] int64, each one's first query row
    n_q: torch.Tensor  # [B] int64, its query rows (causal: each sees one key more)
    page_start: torch.Tensor  # [B] int64, where each one's pages begin in kv_indices
    kv_lens: torch.Tensor  # [B] int64, the keys its last query row sees
    kv_indices: torch.Tensor  # [num_pages] int32, the step's whole page list


# Chunks of at most this many queries behind a prefix run as decodes: in the compiled
# kernel as one sequence of several query rows (a verify of 1 + K tokens reads its
# context once, for K up to 15 as the few-row linear kernel takes them); in plain torch
# one decode per query row.
MAX_ROWS_AS_DECODES = 8
MAX_ROWS_IN_KERNEL = 16


def _pages(indices: list[int], device: torch.device) -> _Pages:
    first, n = indices[0], len(indices)
    if indices == list(range(first, first + n)):
        return _Pages(first, n, None)
    return _Pages(first, n, torch.tensor(indices, dtype=torch.long, device=device))


class TorchAttentionBackend:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | None = None, kernels: ModuleType | None = None,
                 prefill_kernel: bool = True, decode_kernel: bool = True) -> None:
        self.device = device or torch.device("cpu")
        self.kernels = kernels if self.device.type == "cpu" else None
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_qo_heads // num_kv_heads
        self._prefills: list[_Prefill] = []
        self._decode: _Decode | None = None
        self._kernel_decode: _KernelBatch | None = None
        self._kernel_prefill: _KernelBatch | None = None
        self._prefill_in_kernel = (self.kernels is not None and prefill_kernel
                                   and head_dim in PREFILL_KERNEL_HEAD_DIMS)
        self._decode_in_kernel = self.kernels is not None and decode_kernel

    def plan(self, meta: AttentionMetadata) -> None:
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        kv_lens = meta.kv_lens().tolist()
        indices = meta.kv_indices.tolist()
        page = meta.page_size
        self._prefills = []
        # one query row each: (row, its first page in kv_indices, its page count, keys)
        decodes: list[tuple[int, int, int, int]] = []
        # the kernels': one per sequence, (first row, query rows, first page, keys)
        grouped: list[tuple[int, int, int, int]] = []
        kernel_prefills: list[tuple[int, int, int, int]] = []
        max_rows = MAX_ROWS_IN_KERNEL if self._decode_in_kernel else MAX_ROWS_AS_DECODES
        for i in range(meta.num_seqs):
            q_len, kv_len = qo[i + 1] - qo[i], kv_lens[i]
            assert 0 < q_len <= kv_len, f"seq {i}: {q_len} queries over {kv_len} keys"
            if q_len == 1 or (q_len <= max_rows and q_len < kv_len):
                grouped.append((qo[i], q_len, kv[i], kv_len))
                for j in range(q_len):  # row j sees the keys up to its own position
                    n = kv_len - q_len + 1 + j
                    decodes.append((qo[i] + j, kv[i], -(-n // page), n))
                continue
            if self._prefill_in_kernel:
                kernel_prefills.append((qo[i], q_len, kv[i], kv_len))
                continue
            self._prefills.append(_Prefill(
                qo[i], q_len, kv_len, _pages(indices[kv[i] : kv[i + 1]], self.device)))
        self._decode, self._kernel_decode, self._kernel_prefill = None, None, None
        kv_indices = (meta.kv_indices.to(torch.int32).contiguous()
                      if (grouped and self._decode_in_kernel) or kernel_prefills else None)
        if kernel_prefills:
            self._kernel_prefill = _kernel_batch(kernel_prefills, kv_indices)
        if self._decode_in_kernel and grouped:
            self._kernel_decode = _kernel_batch(grouped, kv_indices)
        else:
            self._decode = self._plan_decode(decodes, indices, page)

    def _plan_decode(self, decodes: list[tuple[int, int, int, int]], indices: list[int],
                     page: int) -> _Decode | None:
        if not decodes:
            return None
        rows = [d[0] for d in decodes]
        row_index = (None if rows == list(range(len(rows)))
                     else torch.tensor(rows, dtype=torch.long, device=self.device))
        lens = [d[3] for d in decodes]
        if len(decodes) == 1:
            _, first, count, n = decodes[0]
            return _Decode(1, row_index, _pages(indices[first : first + count], self.device),
                           None, n, None)
        num_pages = max(d[2] for d in decodes)
        table = torch.zeros(len(decodes), num_pages, dtype=torch.long)  # page 0 pads
        for b, (_, first, count, _) in enumerate(decodes):
            table[b, :count] = torch.tensor(indices[first : first + count])
        padded = num_pages * page
        mask = None
        if any(n != padded for n in lens):
            ctx = torch.tensor(lens)[:, None, None, None]  # [B, 1, 1, 1]
            mask = (torch.arange(padded)[None, None, None, :] < ctx).to(self.device)
        return _Decode(len(decodes), row_index, None, table.to(self.device), max(lens), mask)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        kv = _Layer(k_cache, v_cache, k_scale, v_scale)
        if self._kernel_decode is not None or self._kernel_prefill is not None:
            return self._forward_with_kernels(q, kv)
        d = self._decode
        if d is not None and not self._prefills and d.rows is None:
            return self._run_decode(q, kv)  # a pure decode step: no scatter
        out = torch.empty_like(q)
        for p in self._prefills:
            out[p.start : p.start + p.q_len] = self._run_prefill(p, q, kv)
        if d is not None:
            if d.rows is None:  # the decodes come first
                out[: d.num] = self._run_decode(q[: d.num], kv)
            else:
                out[d.rows] = self._run_decode(q[d.rows], kv)
        return out

    def _forward_with_kernels(self, q: torch.Tensor, kv: _Layer) -> torch.Tensor:
        """Each kernel writes the rows of its own sequences; the prefills and decodes whose
        kernel is not used (a head dim the prefill kernel lacks, the kernel choice) run in
        torch."""
        assert self.kernels is not None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = 1.0 / math.sqrt(self.head_dim)
        for p in self._prefills:
            out[p.start : p.start + p.q_len] = self._run_prefill(p, q, kv)
        d = self._decode
        if d is not None:
            rows = slice(0, d.num) if d.rows is None else d.rows
            out[rows] = self._run_decode(q[rows], kv)
        for run, b in ((self.kernels.paged_prefill, self._kernel_prefill),
                       (self.kernels.paged_decode, self._kernel_decode)):
            if b is not None:
                run(out, q, kv.k, kv.v, b.rows, b.n_q, b.page_start, b.kv_lens, b.kv_indices,
                    scale, kv.k_scale, kv.v_scale)
        return out

    def _run_prefill(self, p: _Prefill, q: torch.Tensor, kv: _Layer) -> torch.Tensor:
        qs = q[p.start : p.start + p.q_len]  # [q_len, H, D]
        k, v = kv.read(p.pages.take, q.dtype)  # [count, page, Hkv, D]
        k = k.flatten(0, 1)[: p.kv_len]  # [kv_len, Hkv, D]
        v = v.flatten(0, 1)[: p.kv_len]
        if p.q_len < p.kv_len:
            return self._run_prefill_after_prefix(p, qs, k, v)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], self._heads(k),
                                           self._heads(v), is_causal=True)
        return o[0].transpose(0, 1)  # [q_len, H, D]

    def _run_prefill_after_prefix(self, p: _Prefill, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor) -> torch.Tensor:
        """A prefill behind a cached prefix, in two fused calls and no mask: the queries
        over the prefix (every key visible) and over their own keys (`is_causal`, which
        is then aligned right), merged by their log-sum-exps. A [q_len, kv_len] mask would
        cost the kernel a pass over it per block and its skipping above the diagonal.

        The G query heads of a KV head become G blocks of query rows ([1, Hkv, G * q_len,
        D]), so K/V are read as they are instead of copied G times; for the causal part
        the blocks are heads of a batch of Hkv, their KV head broadcast to them."""
        q_len, hkv, g, dim = p.q_len, self.num_kv_heads, self.group, self.head_dim
        prefix = p.kv_len - q_len
        qf = q.view(q_len, hkv, g, dim).permute(1, 2, 0, 3).reshape(1, hkv, g * q_len, dim)
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, kv_len, D]
        o_prefix, lse_prefix = _flash(qf, kt[None, :, :prefix], vt[None, :, :prefix])
        own = (hkv, g, q_len, dim)
        o_own, lse_own = _flash(qf.view(own), kt[:, None, prefix:].expand(own),
                                vt[:, None, prefix:].expand(own), is_causal=True)
        lse_own = lse_own.reshape(lse_prefix.shape)  # [1, Hkv, G * q_len]
        lse = torch.maximum(lse_prefix, lse_own)
        w_prefix = (lse_prefix - lse).exp()[..., None]
        w_own = (lse_own - lse).exp()[..., None]
        o = ((o_prefix.float() * w_prefix + o_own.reshape(o_prefix.shape).float() * w_own)
             / (w_prefix + w_own)).to(q.dtype)
        return o.view(hkv, g, q_len, dim).permute(2, 0, 1, 3).reshape(q_len, self.num_qo_heads,
                                                                     dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, D] -> [1, H, L, D]: each KV head repeated for its G query heads (a
        copy when G > 1: the fused kernel takes no grouped heads)."""
        x = x.transpose(0, 1)  # [Hkv, L, D]
        if self.group > 1:
            hkv, length, d = x.shape
            x = x[:, None].expand(hkv, self.group, length, d).reshape(-1, length, d)
        return x[None]

    def _run_decode(self, q: torch.Tensor, kv: _Layer) -> torch.Tensor:
        """q: [B, H, D], one query per sequence -> [B, H, D]."""
        d = self._decode
        assert d is not None
        b, h, dim = q.shape
        if d.pages is not None:  # one sequence
            k, v = kv.read(d.pages.take, q.dtype)
            k = k.flatten(0, 1)[None, : d.kv_len]  # [1, L, Hkv, D]
            v = v.flatten(0, 1)[None, : d.kv_len]
        else:
            k, v = kv.read(lambda pages: pages[d.page_index], q.dtype)
            k = k.flatten(1, 2)  # [B, P * page, Hkv, D]
            v = v.flatten(1, 2)
        qg = q.view(b, self.num_kv_heads, self.group, dim)  # [B, Hkv, G, D]: head h -> h // G
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=d.mask)  # [B, Hkv, G, D]
        return o.reshape(b, h, dim)


def _kernel_batch(seqs: list[tuple[int, int, int, int]],
                  kv_indices: torch.Tensor) -> _KernelBatch:
    """(first row, query rows, first page, keys) per sequence -> the kernels' tensors."""
    rows, n_q, page_start, kv_lens = (torch.tensor(col, dtype=torch.long) for col in zip(*seqs))
    return _KernelBatch(rows, n_q, page_start, kv_lens, kv_indices)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's fused CPU kernel, which also returns the log-sum-exp of each query row's
    scores ([B, H, L] float32) that `F.scaled_dot_product_attention` drops."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal)
    return out, lse
