"""Paged attention backends against dense causal attention on random inputs.

Pages are shuffled (a sequence's KV is scattered over the pool), heads are
grouped (GQA), some sequences have a cached prefix (queries only at the end),
some decode one token. The same cases run against FlashInfer on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.attention import AttentionMetadata, create_backend

PAGE = 16
CASES = [
    # (q_len, kv_len) per sequence: plain prefill, cached prefixes, decodes, page edges
    [(37, 37)],
    [(5, 40), (1, 1), (16, 16), (1, 33)],
    [(1, 17), (1, 64), (1, 5)],
    [(20, 100), (64, 64), (3, 48), (1, 16)],
]


def dense_reference(q, k, v):
    """q: [q_len, H, D]; k, v: [kv_len, Hkv, D]; bottom-right causal, GQA by repeat."""
    q_len, heads, d = q.shape
    kv_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1).float()
    v = v.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(d)
    pos_q = torch.arange(q_len)[:, None] + kv_len - q_len
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_case(lens, heads, kv_heads, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv // PAGE) for _, kv in lens) + 7
    k_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    qs, refs, qo, kvp, idx, last = [], [], [0], [0], [], []
    for q_len, kv_len in lens:
        n = -(-kv_len // PAGE)
        pages, perm = perm[:n], perm[n:]
        k = k_cache[pages].flatten(0, 1)[:kv_len]
        v = v_cache[pages].flatten(0, 1)[:kv_len]
        q = torch.randn(q_len, heads, d, generator=g).to(dtype)
        qs.append(q)
        refs.append(dense_reference(q, k, v))
        qo.append(qo[-1] + q_len)
        idx += pages
        kvp.append(len(idx))
        last.append(kv_len - (n - 1) * PAGE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(i32(qo), i32(kvp), i32(idx), i32(last), PAGE)
    return (torch.cat(qs).to(device), k_cache.to(device), v_cache.to(device), meta,
            torch.cat(refs))


def run_backend(name, lens, heads, kv_heads, d, dtype, device):
    q, k_cache, v_cache, meta, ref = build_case(lens, heads, kv_heads, d, dtype, device)
    backend = create_backend(name, heads, kv_heads, d, PAGE, dtype, torch.device(device))
    backend.plan(meta)
    out = backend.forward(q, k_cache, v_cache).float().cpu()
    return out, ref


@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_torch_backend_matches_dense(lens, heads, kv_heads):
    out, ref = run_backend("torch", lens, heads, kv_heads, 32, torch.float32, "cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_exact_page_table_ignores_stale_tail():
    """Garbage after the last valid token of the last page must not leak in."""
    lens = [(3, 21)]
    q, k_cache, v_cache, meta, ref = build_case(lens, 4, 2, 16, torch.float32, "cpu")
    page = meta.kv_indices[-1].item()
    k_cache[page, 5:] = 1e4  # slots past kv_last_page_len (21 - 16 = 5)
    backend = create_backend("torch", 4, 2, 16, PAGE, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache), ref, atol=1e-5, rtol=1e-5)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 4), (32, 8)])
def test_flashinfer_matches_torch_backend_bf16(lens, heads, kv_heads):
    fi, ref = run_backend("flashinfer", lens, heads, kv_heads, 128, torch.bfloat16, "cuda")
    tb, _ = run_backend("torch", lens, heads, kv_heads, 128, torch.bfloat16, "cuda")
    rel = (fi - tb).norm() / tb.norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"
    assert (fi - ref).norm() / ref.norm() < 1e-2
