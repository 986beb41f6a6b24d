"""The fused elementwise kernels (worker/csrc/elementwise.cpp) against the plain-torch
passes they replace (worker/elementwise.py's fallback, HF's rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import cpu_kernels
from worker.elementwise import Elementwise
from worker.layers import rms_norm

CPU = torch.device("cpu")


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: float32 rounding; bfloat16: at most one bf16 rounding step apart."""
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    scale = ref.float().abs().max().item()
    tol = 2e-6 if dtype == torch.float32 else 2 ** -7
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"{err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(1, 576), (7, 64), (300, 576), (3, 33)])
def test_rms_norm(kernels, dtype, rows, d):
    g = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    close(kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), dtype)
    # a view whose rows are strided (a slice of a wider tensor)
    wide = torch.randn(rows, 2 * d, generator=g).to(dtype)[:, :d]
    close(kernels.rms_norm(wide, w, 1e-6), rms_norm(wide, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_sums_the_residual_in_place(kernels, dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 128, generator=g).to(dtype)
    delta = torch.randn(40, 128, generator=g).to(dtype)
    w = torch.rand(128, generator=g).to(dtype)
    expected_h = h + delta
    out = kernels.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)  # the sum, rounded to the dtype, exactly as torch
    close(out, rms_norm(expected_h, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 96), (5, 17)])
def test_silu_mul(kernels, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows * inter)
    # values across SiLU's range, large negative ones included (exp must not overflow)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(kernels.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 9, 3, 64), (5, 8, 4, 64), (70, 4, 2, 32),
                                                   (3, 8, 1, 128)])
@pytest.mark.parametrize("scaling", [1.0, 1.23])
def test_rope_store_kv_is_the_torch_rotary_and_writes_bit_for_bit(kernels, dtype, rows, heads,
                                                                  kv_heads, d, scaling):
    """rope_store_kv against the model's torch path (Rotary.apply over q and k, then
    KVCache.write): the same q, the same pages, to the bit, in both dtypes; other slots
    untouched."""
    from worker.kv_cache import KVCache
    from worker.layers import Rotary

    g = torch.Generator().manual_seed(rows * heads + d)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype)
    positions = torch.randint(0, 5000, (rows,), generator=g)
    inv_freq = [10000.0 ** (-2 * i / d) for i in range(d // 2)]
    cos, sin = Rotary(inv_freq, CPU, scaling).cos_sin(positions, dtype)
    slots = torch.randperm(6 * 16, generator=g)[:rows]  # scattered over 6 pages of 16
    caches = []
    for _ in range(2):
        kv = KVCache(1, 6, 0, 16, kv_heads, d, dtype, CPU)
        kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(7)).to(dtype))
        kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(8)).to(dtype))
        caches.append(kv)
    q = kernels.rope_store_kv(qkv, cos, sin, caches[0].k[0], caches[0].v[0], slots, heads)
    both = heads + kv_heads
    qk = Rotary.apply(qkv[:, : both * d].view(rows, both, d), cos, sin)
    q_ref, k_ref = qk.split([heads, kv_heads], dim=1)
    caches[1].write(0, k_ref, qkv[:, both * d :].view(rows, kv_heads, d), slots)
    assert q.shape == (rows, heads, d) and torch.equal(q, q_ref)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_rope_store_kv_refuses_a_slot_outside_the_pages(kernels):
    qkv = torch.zeros(2, (2 + 2) * 8)
    pages = torch.zeros(2, 4, 1, 8)
    cos = sin = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pages"):
        kernels.rope_store_kv(qkv, cos, sin, pages, pages.clone(), torch.tensor([0, 8]), 2)


def test_refuses_what_it_cannot_compute(kernels):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rms_norm(torch.randn(2, 8).half(), torch.randn(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="one weight per column"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        kernels.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("switch", ["1", "0", "torch by choice"])
def test_elementwise_both_ways_equals_torch(switch, monkeypatch):
    """worker.elementwise with the kernels and without (DEEPINFER_CPU_KERNELS=0, or the
    rank's kernel choice: `use_kernels=False`): the same results, and the residual summed
    in place both ways."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0" if switch == "0" else "1")
    ops = Elementwise(CPU, torch.float32, use_kernels=switch != "torch by choice")
    assert (ops.kernels is None) == (switch != "1" or cpu_kernels.load() is None)
    g = torch.Generator().manual_seed(2)
    h, delta = torch.randn(9, 64, generator=g), torch.randn(9, 64, generator=g)
    w = torch.rand(64, generator=g)
    summed = h + delta
    close(ops.add_rms_norm(h, delta, w, 1e-5), rms_norm(summed, w, 1e-5), torch.float32)
    assert torch.equal(h, summed)
    gu = torch.randn(9, 128, generator=g)
    close(ops.silu_mul(gu), F.silu(gu[:, :64]) * gu[:, 64:], torch.float32)
    # 3-D (per-head norms of Qwen3): the torch path
    x3 = torch.randn(2, 4, 64, generator=g)
    close(ops.rms_norm(x3, w, 1e-5), rms_norm(x3, w, 1e-5), torch.float32)


def test_float16_models_keep_torch():
    assert Elementwise(CPU, torch.float16).kernels is None


FP8_KINDS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("fp8", FP8_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 9, 3, 64), (70, 4, 2, 32),
                                                   (40, 8, 1, 128)])
def test_rope_store_kv_quantizes_fp8_as_the_torch_write_does(kernels, fp8, dtype, rows, heads,
                                                             kv_heads, d):
    """FP8 pages: the rotated K (rounded to the dtype) and V quantized per token and head,
    bytes and scales bit for bit those of KVCache.write (worker/kv_quant.py); rows at
    magnitudes from 1e-6 to 1e4, a zero head among them."""
    from worker.kv_cache import KVCache
    from worker.layers import Rotary

    g = torch.Generator().manual_seed(rows * heads + d)
    size = torch.logspace(-6, 4, rows)[:, None]
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g) * size).to(dtype)
    qkv[0, heads * d : (heads + 1) * d] = 0  # a zero K head: scale 1
    positions = torch.randint(0, 5000, (rows,), generator=g)
    inv_freq = [10000.0 ** (-2 * i / d) for i in range(d // 2)]
    cos, sin = Rotary(inv_freq, CPU, 1.0).cos_sin(positions, dtype)
    slots = torch.randperm(8 * 16, generator=g)[:rows]
    caches = [KVCache(1, 8, 0, 16, kv_heads, d, fp8, CPU) for _ in range(2)]
    q = kernels.rope_store_kv(qkv, cos, sin, caches[0].k[0], caches[0].v[0], slots, heads,
                              *caches[0].scales(0))
    both = heads + kv_heads
    qk = Rotary.apply(qkv[:, : both * d].view(rows, both, d), cos, sin)
    q_ref, k_ref = qk.split([heads, kv_heads], dim=1)
    caches[1].write(0, k_ref, qkv[:, both * d :].view(rows, kv_heads, d), slots)
    assert torch.equal(q, q_ref)
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(caches[0].k_scale, caches[1].k_scale)
    assert torch.equal(caches[0].v_scale, caches[1].v_scale)
    assert caches[0].k_scale[0].flatten()[slots[0] * kv_heads] == 1


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_rope_store_kv_rounds_to_fp8_as_torch_at_every_edge(kernels, fp8):
    """V goes to the pages unrotated, so these rows reach the quantizer as they are: every
    FP8 value, every midpoint between two (round to even), the floats just either side of
    each midpoint, subnormals, both zeros, random values, each row's largest at the format's
    max (scale 1, so the values are the FP8 inputs). Each byte is torch's conversion's."""
    from worker.kv_cache import KVCache

    limit = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[fp8]
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values) & (values.abs() <= limit)].abs().unique()
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(5)
    edges = torch.cat([values, mids, torch.nextafter(mids, torch.zeros(1)),
                       torch.nextafter(mids, torch.full((1,), limit)),
                       torch.rand(2000, generator=g) * limit,
                       torch.rand(2000, generator=g) * values[8]])  # among the subnormals
    edges = torch.cat([edges, -edges, torch.tensor([0.0, -0.0])])
    d = 64
    rows = -(-len(edges) // (d - 1))
    v = torch.zeros(rows * (d - 1))
    v[: len(edges)] = edges
    v = torch.cat([v.view(rows, d - 1), torch.full((rows, 1), limit)], 1)
    qkv = torch.cat([torch.zeros(rows, 2 * d), v], 1)  # one q head, one KV head of zeros
    cos, sin = torch.ones(rows, 1, d), torch.zeros(rows, 1, d)
    kv = KVCache(1, rows, 0, 1, 1, d, fp8, CPU)
    kernels.rope_store_kv(qkv, cos, sin, kv.k[0], kv.v[0], torch.arange(rows), 1,
                          *kv.scales(0))
    assert torch.equal(kv.v_scale.flatten(), torch.ones(rows))
    assert torch.equal(kv.v[0].view(torch.uint8).view(rows, d), v.to(fp8).view(torch.uint8))


def test_rope_store_kv_refuses_fp8_pages_without_scales(kernels):
    qkv = torch.zeros(2, 3 * 8)
    pages = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    cos = sin = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rope_store_kv(qkv, cos, sin, pages, pages.clone(), torch.tensor([0, 5]), 1)
    with pytest.raises(RuntimeError, match="both scales or none"):
        kernels.rope_store_kv(qkv, cos, sin, pages, pages.clone(), torch.tensor([0, 5]), 1,
                              torch.ones(2, 4, 1))
