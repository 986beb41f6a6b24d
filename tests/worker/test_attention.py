"""Paged attention backends against dense causal attention on random inputs.

Pages are shuffled (a sequence's KV is scattered over the pool), heads are
grouped (GQA), some sequences have a cached prefix (queries only at the end),
some decode one token. The same cases run against FlashInfer on CUDA.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from worker import cpu_kernels
from worker.attention import AttentionMetadata, create_backend
from worker.kernel_choice import ENV_CHOICE

PAGE = 16
CASES = [
    # (q_len, kv_len) per sequence: plain prefill, cached prefixes, decodes, page edges
    [(37, 37)],
    [(5, 40), (1, 1), (16, 16), (1, 33)],
    [(1, 17), (1, 64), (1, 5)],
    [(20, 100), (64, 64), (3, 48), (1, 16)],
]


# The rank's kernel choice (worker/kernel_choice.py) forced one way or the other: the
# torch paths by choice, and one kernel with the other path in torch in the same step.
FORCED_CHOICES = {"torch": "torch", "prefill-kernel": "prefill=kernels,decode=torch",
                  "decode-kernel": "prefill=torch,decode=kernels"}


@pytest.fixture(params=["kernel", "gathered", *FORCED_CHOICES])
def torch_path(request, monkeypatch):
    """The torch backend both ways: decodes through the compiled CPU kernel, and through
    the plain-torch gather + SDPA (DEEPINFER_CPU_KERNELS=0); and as the kernel choice
    forces it (DEEPINFER_KERNEL_CHOICE): torch, or one of the two attention kernels."""
    if request.param == "gathered":
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    elif cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    elif request.param in FORCED_CHOICES:
        monkeypatch.setenv(ENV_CHOICE, FORCED_CHOICES[request.param])
    return request.param


def test_cpu_kernel_builds_where_there_is_a_compiler():
    """The kernel must not quietly fall back on a machine that can build it."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    assert cpu_kernels.load() is not None


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


def build_case(lens, heads, kv_heads, d, dtype, device, seed=0, shuffle=True):
    """Random q and KV pages for `lens`; `shuffle=False` gives each sequence consecutive
    page ids (the backend reads those as a slice, without a gather)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv // PAGE) for _, kv in lens) + 7
    k_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    perm = (torch.randperm(num_pages, generator=g) if shuffle
            else torch.arange(num_pages)).tolist()
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


def run_backend(name, lens, heads, kv_heads, d, dtype, device, shuffle=True):
    q, k_cache, v_cache, meta, ref = build_case(lens, heads, kv_heads, d, dtype, device,
                                                shuffle=shuffle)
    backend = create_backend(name, heads, kv_heads, d, PAGE, dtype, torch.device(device))
    backend.plan(meta)
    out = backend.forward(q, k_cache, v_cache).float().cpu()
    return out, ref


@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_torch_backend_matches_dense(lens, heads, kv_heads, torch_path):
    out, ref = run_backend("torch", lens, heads, kv_heads, 32, torch.float32, "cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# The torch backend's own paths: decodes batched into one padded call (contexts of very
# different lengths, page-size edges), decodes after or between prefills (their query rows
# scattered), one decode alone, prefills with and without a cached prefix in one step.
PATH_CASES = [
    [(1, 1), (1, 16), (1, 17), (1, 200), (1, 3), (1, 48)],
    [(30, 30), (1, 9), (12, 50), (1, 70), (1, 32)],
    [(1, 20), (1, 90), (7, 7), (16, 33)],
    [(1, 129)],
    [(64, 64), (16, 48)],
    # drafted decodes (speculative decoding): short chunks behind a prefix run as decodes
    # of several query rows (plain torch: one decode per row); at the size limit, past it
    # (a prefill), and with no prefix
    [(5, 40), (1, 17), (8, 100), (2, 16), (9, 60), (3, 3)],
    [(4, 33)],
    # the kernel's context splits (256 keys): rows on either side of a split's edge, and
    # a row whose last split it does not see at all
    [(6, 260), (8, 513), (1, 257), (3, 258)],
    # the kernel's limit (16 rows: 1 + 15 drafts), past it, and plain torch's (8) between
    [(16, 300), (17, 80), (12, 257), (9, 9)],
]


@pytest.mark.parametrize("shuffle", [True, False], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("lens", PATH_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (9, 3), (8, 2)])  # G = 1, 2, 3, 4
def test_torch_backend_paths_match_dense(lens, heads, kv_heads, shuffle, torch_path):
    out, ref = run_backend("torch", lens, heads, kv_heads, 32, torch.float32, "cpu", shuffle)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_torch_backend_takes_the_fused_kernel(torch_path):
    """Never SDPA's math fallback (it builds the whole score matrix): grouped heads,
    batched decodes, a cached prefix and a plain prefill all reach the flash kernel (or,
    with the compiled CPU kernels, those: no SDPA call at all)."""
    from torch.profiler import profile

    q, k_cache, v_cache, meta, _ = build_case(PATH_CASES[1], 9, 3, 32, torch.float32, "cpu")
    backend = create_backend("torch", 9, 3, 32, PAGE, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    with profile() as prof:
        backend.forward(q, k_cache, v_cache)
    ops = [e.key for e in prof.key_averages()]
    assert "aten::_scaled_dot_product_attention_math" not in ops
    # one call for the plain prefill; in plain torch two for the 12 queries behind a cached
    # prefix (over the prefix, then causal over its own keys) and one for the three
    # batched decodes; the decode kernel takes both of those (12 rows: a verify's size),
    # the prefill kernel the plain prefill. With one of them only, one call: the decodes'
    # (the 12 rows, past torch's 8 for decodes, go to the prefill kernel), or the plain
    # prefill's.
    assert [e.count for e in prof.key_averages()
            if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu"] == (
                [] if torch_path == "kernel" else
                {"prefill-kernel": [1], "decode-kernel": [1]}.get(torch_path, [4]))


@pytest.mark.parametrize("lens", [[(3, 21)], [(1, 21)], [(1, 40), (1, 21)]])
def test_exact_page_table_ignores_stale_tail(lens, torch_path):
    """Garbage after the last valid token of the last page must not leak in (nor, in a
    batched decode, the padding up to the longest sequence's pages)."""
    q, k_cache, v_cache, meta, ref = build_case(lens, 4, 2, 16, torch.float32, "cpu")
    page = meta.kv_indices[-1].item()
    k_cache[page, 5:] = 1e4  # slots past kv_last_page_len (21 - 16 = 5)
    v_cache[page, 5:] = 1e4
    backend = create_backend("torch", 4, 2, 16, PAGE, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache), ref, atol=1e-5, rtol=1e-5)


def test_auto_takes_flashinfer_only_for_16_bit_cuda():
    """float32 on CUDA (the exactness checks against the CPU) runs the torch backend:
    FlashInfer's kernels take 16-bit queries and KV only."""
    from worker.attention.torch_backend import TorchAttentionBackend

    cuda = torch.device("cuda")  # nothing touches the device before the choice
    assert isinstance(create_backend("auto", 4, 2, 64, PAGE, torch.float32, cuda),
                      TorchAttentionBackend)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        create_backend("flashinfer", 4, 2, 64, PAGE, torch.float32, cuda)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend("flashinfer", 4, 2, 64, PAGE, torch.bfloat16, torch.device("cpu"))


def test_auto_takes_flashinfer_only_for_the_head_dims_it_has_kernels_for():
    """A head dim FlashInfer has no kernel for (the tiny hybrids' 32) runs the torch
    backend: FlashInfer's prefill reads out of bounds there instead of refusing."""
    from worker.attention.torch_backend import TorchAttentionBackend

    cuda = torch.device("cuda")  # nothing touches the device before the choice
    assert isinstance(create_backend("auto", 4, 4, 32, PAGE, torch.bfloat16, cuda),
                      TorchAttentionBackend)
    with pytest.raises(ValueError, match="head dims"):
        create_backend("flashinfer", 4, 4, 32, PAGE, torch.bfloat16, cuda)


# --- FlashInfer (CUDA): the same paged cases, bf16, against the torch backend ------------


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 4), (32, 8)])
def test_flashinfer_matches_torch_backend_bf16(lens, heads, kv_heads):
    fi, ref = run_backend("flashinfer", lens, heads, kv_heads, 128, torch.bfloat16, "cuda")
    tb, _ = run_backend("torch", lens, heads, kv_heads, 128, torch.bfloat16, "cuda")
    assert relative_error(fi, tb) < 1e-2, f"relative error {relative_error(fi, tb):.2e}"
    assert relative_error(fi, ref) < 1e-2


# (cached prefix, new tokens) per sequence: a prefill over a cached prefix, as the
# engine runs it; all new tokens (1 each) is a decode step.
WRITE_CASES = [
    [(0, 37)],
    [(40, 5), (0, 16), (33, 1), (16, 16)],
    [(100, 20), (45, 3), (15, 1), (0, 64)],
    [(16, 1), (63, 1), (4, 1), (200, 1)],
]


def write_then_attend(cases, heads, kv_heads, d, dtype, device, backends):
    """The engine's order: the prefix's KV is in its pages, the new tokens' K/V are
    written there first (KVCache.write at block * size + offset), then one paged
    attention over the whole context (a prefill with bottom-right causal masking, or a
    decode). Returns each backend's output and dense attention on the same K/V."""
    from worker.kv_cache import KVCache

    dev = torch.device(device)
    g = torch.Generator().manual_seed(len(cases) * heads)
    num_pages = sum(-(-(p + n) // PAGE) for p, n in cases) + 5
    cache = KVCache(1, num_pages, 0, PAGE, kv_heads, d, dtype, dev)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))  # stale KV everywhere
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    perm = torch.randperm(num_pages, generator=g).tolist()
    qs, new_k, new_v, new_slots, refs = [], [], [], [], []
    qo, kvp, idx, last = [0], [0], [], []
    for prefix, n in cases:
        total = prefix + n
        num = -(-total // PAGE)
        pages, perm = perm[:num], perm[num:]
        k = torch.randn(total, kv_heads, d, generator=g).to(dtype)  # [total, Hkv, D]
        v = torch.randn(total, kv_heads, d, generator=g).to(dtype)
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(total)])
        cache.write(0, k[:prefix].to(dev), v[:prefix].to(dev), slots[:prefix].to(dev))
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        qs.append(q)
        new_k.append(k[prefix:])
        new_v.append(v[prefix:])
        new_slots.append(slots[prefix:])
        refs.append(dense_reference(q, k, v))
        qo.append(qo[-1] + n)
        idx += pages
        kvp.append(len(idx))
        last.append(total - (num - 1) * PAGE)
    cache.write(0, torch.cat(new_k).to(dev), torch.cat(new_v).to(dev),
                torch.cat(new_slots).to(dev))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(i32(qo), i32(kvp), i32(idx), i32(last), PAGE)
    assert meta.is_decode == all(n == 1 for _, n in cases)
    q = torch.cat(qs).to(dev)  # [num_tokens, heads, head_dim]
    outs = {}
    for name in backends:
        backend = create_backend(name, heads, kv_heads, d, PAGE, dtype, dev)
        backend.plan(meta)
        outs[name] = backend.forward(q, cache.k[0], cache.v[0]).float().cpu()
    return outs, torch.cat(refs)


@pytest.mark.parametrize("cases", WRITE_CASES)
def test_torch_backend_after_writing_new_tokens_to_pages(cases, torch_path):
    outs, ref = write_then_attend(cases, 8, 2, 32, torch.float32, "cpu", ["torch"])
    torch.testing.assert_close(outs["torch"], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [PATH_CASES[0], PATH_CASES[1], [(1, 700), (1, 3)]])
def test_cpu_kernel_in_16_bit_matches_the_gathered_path(lens, dtype, monkeypatch):
    """16-bit KV: the kernel accumulates in float32 and rounds once, so it stays within
    the 16-bit rounding of the gathered SDPA path (which rounds its own way)."""
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler")
    kernel, ref = run_backend("torch", lens, 8, 2, 64, dtype, "cpu")
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    gathered, _ = run_backend("torch", lens, 8, 2, 64, dtype, "cpu")
    assert relative_error(kernel, ref) < 1e-2
    assert relative_error(kernel, gathered) < 1e-2


# The decode kernel's shapes: its vector path takes head dims 64 and 128 (16 keys a
# vector pass, a value tile of up to 24 / (D / 16) query rows: 1 + 15 drafts of G = 4 is
# several tiles and a tail), other head dims its scalar loop.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (9, 3, 64), (8, 1, 128), (8, 2, 128),
                                              (4, 2, 32)])
@pytest.mark.parametrize("lens", [PATH_CASES[0], PATH_CASES[5], PATH_CASES[7], PATH_CASES[8]])
def test_decode_kernel_matches_dense(lens, heads, kv_heads, d, dtype, kernels):
    """paged_decode (decodes and short chunks behind a prefix) against dense attention:
    float32 as strict as the torch paths, 16-bit within its rounding (bf16 dot products
    in bf16 pairs, summed in float32)."""
    out, ref = run_backend("torch", lens, heads, kv_heads, d, dtype, "cpu")
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_streaming_the_next_split_keeps_every_bit(dtype, kernels):
    """Many splits a thread (4 x 1,500 keys and a verify of 5 rows): each thread claims
    its next split ahead and fetches its rows while it computes one. Which thread takes
    which split, and in what order, changes no bit, and the result is dense attention's."""
    lens = [(1, 1500), (1, 1490), (5, 1510), (1, 1300)]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, ref = run_backend("torch", lens, 9, 3, 64, dtype, "cpu")
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    if dtype == torch.float32:
        torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)
    else:
        assert relative_error(outs[0], ref) < 1e-2


# Decodes whose page lists share a prefix (the agents' system prompt through the prefix
# cache): (query rows, keys, (the sequence it shares with, pages shared) or None). The
# kernel reads a split of 256 keys once for every sequence naming the same pages there.
SHARED_PREFIX_CASES = [
    # four agents on 40 shared pages (640 keys: two whole splits), one verifying 4 rows;
    # a fork sharing 17 pages (one split); 10 pages (no whole split); one alone; one
    # whose whole context is the shared splits (no split of its own)
    [(1, 900), (1, 700, (0, 40)), (4, 1100, (0, 40)), (1, 641, (0, 40)), (1, 800, (0, 17)),
     (1, 500, (0, 10)), (1, 300), (1, 512, (0, 32))],
    # more sequences on one prefix than an item's rows hold (144: 16 of 9 heads)
    [(1, 600)] + [(1, 520 + 7 * i, (0, 33)) for i in range(19)],
]
# Each case's shared items, (split, sequences) (for 9 heads): split 0 by all that share a
# whole split, split 1 by those sharing two.
SHARED_ITEMS = [
    [(0, [0, 1, 2, 3, 7, 4]), (1, [0, 1, 2, 3, 7])],
    [(0, list(range(16))), (0, list(range(16, 20))), (1, list(range(16))),
     (1, list(range(16, 20)))],
]


def build_shared_case(specs, heads, kv_heads, d, dtype, seed=0):
    """q and KV pages for `specs` (see SHARED_PREFIX_CASES), the pages scattered; a
    sequence sharing n pages with another names the same n page ids first."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-spec[1] // PAGE) for spec in specs) + 7
    k_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, kv_heads, d, generator=g).to(dtype)
    free = torch.randperm(num_pages, generator=g).tolist()
    seqs = []  # (q, its pages, kv_len)
    for q_len, kv_len, *share in specs:
        n = -(-kv_len // PAGE)
        shared = seqs[share[0][0]][1][: share[0][1]] if share else []
        fresh, free = free[: n - len(shared)], free[n - len(shared):]
        pages = shared + fresh
        seqs.append((torch.randn(q_len, heads, d, generator=g).to(dtype), pages, kv_len))
    return seqs, k_cache, v_cache


def decode_metadata(seqs):
    qo, kvp, idx, last = [0], [0], [], []
    for q, pages, kv_len in seqs:
        qo.append(qo[-1] + q.shape[0])
        idx += pages
        kvp.append(len(idx))
        last.append(kv_len - (len(pages) - 1) * PAGE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(i32(qo), i32(kvp), i32(idx), i32(last), PAGE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 32)])
@pytest.mark.parametrize("case", range(len(SHARED_PREFIX_CASES)))
def test_decode_kernel_reads_a_shared_prefix_once_with_the_same_result(case, heads, kv_heads,
                                                                       d, dtype, kernels):
    """Sequences on shared pages decode together bit for bit as each does alone (a split
    is where it would be alone, and a row's sums do not depend on its neighbours), and
    as dense attention does; a shared split is one work item for all who share it."""
    seqs, k_cache, v_cache = build_shared_case(SHARED_PREFIX_CASES[case], heads, kv_heads, d,
                                               dtype)
    backend = create_backend("torch", heads, kv_heads, d, PAGE, dtype, torch.device("cpu"))
    meta = decode_metadata(seqs)
    backend.plan(meta)
    if heads == 9:
        b = backend._kernel_decode
        items = kernels.paged_decode_items(b.n_q, b.page_start, b.kv_lens, b.kv_indices,
                                           heads, PAGE)
        assert [(s, m) for s, m in items if len(m) > 1] == SHARED_ITEMS[case]
        # every split of every sequence once
        assert sorted((s, x) for s, m in items for x in m) == sorted(
            (s, x) for x, (_, _, kv_len) in enumerate(seqs) for s in range(-(-kv_len // 256)))
    together = backend.forward(torch.cat([q for q, _, _ in seqs]), k_cache, v_cache)
    row = 0
    for q, pages, kv_len in seqs:
        backend.plan(decode_metadata([(q, pages, kv_len)]))
        alone = backend.forward(q, k_cache, v_cache)
        assert torch.equal(together[row : row + q.shape[0]], alone)
        k = k_cache[pages].flatten(0, 1)[:kv_len]
        v = v_cache[pages].flatten(0, 1)[:kv_len]
        ref = dense_reference(q, k, v)
        if dtype == torch.float32:
            torch.testing.assert_close(alone.float(), ref, atol=1e-5, rtol=1e-5)
        else:
            assert relative_error(alone, ref) < 1e-2
        row += q.shape[0]


# The prefill kernel's edges: several key blocks (128 keys) and query blocks (128 tokens)
# with the causal diagonal across both, an odd key count (the bf16 path pairs keys), chunks
# with no prefix (3 tokens: no decode-sized shortcut) and behind one, next to decodes.
PREFILL_KERNEL_CASES = [
    [(130, 300)],
    [(200, 200), (1, 77)],
    [(3, 3), (65, 65), (17, 131)],
    [(97, 400), (129, 129), (2, 5)],
    [(300, 300), (257, 520)],
    [(128, 384), (256, 256)],  # blocks and chunks ending on key-block edges
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (9, 3, 64), (8, 1, 128), (4, 2, 32)])
@pytest.mark.parametrize("lens", PREFILL_KERNEL_CASES)
def test_prefill_kernel_matches_dense(lens, heads, kv_heads, d, dtype, kernels):
    """paged_prefill against dense attention: float32 as strict as the torch paths; 16-bit
    within the 16-bit rounding of the gathered SDPA path (bf16 multiplies in bf16 pairs,
    its softmax weights rounded to bf16 for the product with V)."""
    out, ref = run_backend("torch", lens, heads, kv_heads, d, dtype, "cpu")
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert relative_error(out, ref) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("cases", WRITE_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_flashinfer_after_writing_new_tokens_to_pages(cases, heads, kv_heads):
    """FlashInfer equals the torch backend and dense attention, bf16, relative error
    under 1e-2, with the new tokens' K/V written to the pages first."""
    outs, ref = write_then_attend(cases, heads, kv_heads, 128, torch.bfloat16, "cuda",
                                  ["flashinfer", "torch"])
    assert relative_error(outs["torch"], ref) < 1e-2
    err = relative_error(outs["flashinfer"], outs["torch"])
    assert err < 1e-2, f"flashinfer vs torch backend: relative error {err:.2e}"
    assert relative_error(outs["flashinfer"], ref) < 1e-2


# --- FP8 KV: every path reads the pages as the values they stand for ---------------------

FP8_KINDS = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_case(lens, heads, kv_heads, d, dtype, fp8, shuffle=True):
    """build_case's q and pages, the pages stored as FP8 with their scales: (q, the FP8
    pages and scales, the same pages read back in q's dtype, metadata)."""
    from worker.kv_quant import dequantize, quantize

    q, k_cache, v_cache, meta, _ = build_case(lens, heads, kv_heads, d, dtype, "cpu",
                                              shuffle=shuffle)
    (k8, k_scale), (v8, v_scale) = quantize(k_cache, fp8), quantize(v_cache, fp8)
    read_back = (dequantize(k8, k_scale, dtype), dequantize(v8, v_scale, dtype))
    return q, (k8, v8, k_scale, v_scale), read_back, meta


def attend(meta, q, heads, kv_heads, d, *pages):
    backend = create_backend("torch", heads, kv_heads, d, PAGE, q.dtype, torch.device("cpu"))
    backend.plan(meta)
    return backend.forward(q, *pages)


@pytest.mark.parametrize("fp8", FP8_KINDS)
@pytest.mark.parametrize("lens", [PATH_CASES[1], PATH_CASES[5], PATH_CASES[7], CASES[3]])
def test_every_path_reads_fp8_pages_as_their_values(lens, fp8, torch_path):
    """Each path (the kernels, the gathered torch paths, the forced mixes) over FP8 pages
    gives bit for bit what it gives over those pages read back (worker/kv_quant.py) in
    q's dtype, and float32 stays as close to dense attention over them as ever."""
    q, fp8_pages, read_back, meta = fp8_case(lens, 8, 2, 32, torch.float32, fp8)
    out = attend(meta, q, 8, 2, 32, *fp8_pages)
    assert torch.equal(out, attend(meta, q, 8, 2, 32, *read_back))
    k, v = read_back
    ref = torch.cat([dense_reference(q[a:b], k[pages].flatten(0, 1)[:n],
                                     v[pages].flatten(0, 1)[:n])
                     for a, b, pages, n in sequences(meta)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def sequences(meta):
    """(first query row, end row, pages, keys) of each sequence of a plan's metadata."""
    qo, kvp, idx = meta.qo_indptr.tolist(), meta.kv_indptr.tolist(), meta.kv_indices.tolist()
    lens = meta.kv_lens().tolist()
    return [(qo[i], qo[i + 1], idx[kvp[i]:kvp[i + 1]], lens[i]) for i in range(meta.num_seqs)]


@pytest.mark.parametrize("fp8", FP8_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (4, 2, 32)])
@pytest.mark.parametrize("lens", [PATH_CASES[8], PREFILL_KERNEL_CASES[3]])
def test_kernels_read_fp8_pages_bit_for_bit(lens, heads, kv_heads, d, dtype, fp8, kernels):
    """paged_decode and paged_prefill widen FP8 rows in registers (times their scales,
    rounded to q's dtype): bit for bit the kernel over the read-back pages, in each dtype,
    on the vector paths (head dims 64, 128) and the scalar decode loop (32); the
    decodes' splits and the prefill's key blocks with partial edges."""
    q, fp8_pages, read_back, meta = fp8_case(lens, heads, kv_heads, d, dtype, fp8)
    backend = create_backend("torch", heads, kv_heads, d, PAGE, dtype, torch.device("cpu"))
    backend.plan(meta)
    assert backend._kernel_decode is not None and backend._kernel_prefill is not None
    assert torch.equal(backend.forward(q, *fp8_pages), backend.forward(q, *read_back))


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_fp8_decodes_on_a_shared_prefix_match_each_alone(fp8, kernels):
    """Sequences reading shared FP8 pages as one work item give bit for bit what each
    gives alone."""
    from worker.kv_quant import quantize

    seqs, k_cache, v_cache = build_shared_case(SHARED_PREFIX_CASES[0], 9, 3, 64, torch.bfloat16)
    (k8, k_scale), (v8, v_scale) = quantize(k_cache, fp8), quantize(v_cache, fp8)
    pages = (k8, v8, k_scale, v_scale)
    together = attend(decode_metadata(seqs), torch.cat([q for q, _, _ in seqs]), 9, 3, 64,
                      *pages)
    row = 0
    for seq in seqs:
        alone = attend(decode_metadata([seq]), seq[0], 9, 3, 64, *pages)
        assert torch.equal(together[row : row + len(seq[0])], alone)
        row += len(seq[0])


def test_kernels_refuse_fp8_pages_without_scales_or_mismatched(kernels):
    q, (k8, v8, k_scale, v_scale), _, meta = fp8_case([(1, 40)], 4, 2, 64, torch.float32,
                                                       torch.float8_e4m3fn)
    backend = create_backend("torch", 4, 2, 64, PAGE, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    b, out = backend._kernel_decode, torch.empty_like(q)
    args = (out, q, k8, v8, b.rows, b.n_q, b.page_start, b.kv_lens, b.kv_indices, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.paged_decode(*args)  # FP8 pages without their scales
    with pytest.raises(RuntimeError, match="scales come with FP8 pages"):
        kernels.paged_decode(out, q, q.new_zeros(k8.shape), q.new_zeros(k8.shape), *args[4:],
                             k_scale, v_scale)
    with pytest.raises(RuntimeError, match="FP8 scales: float32"):
        kernels.paged_decode(*args, k_scale[:, :8], v_scale[:, :8])
