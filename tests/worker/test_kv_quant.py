"""FP8 KV (worker/kv_quant.py): a scale per token and KV head, values within half an FP8
step of their input, and the KV dtype a rank resolves from --kv-cache-dtype."""

from __future__ import annotations

import pytest
import torch

from worker.budget import StartupError, resolve_kv_dtype
from worker.kv_cache import KVCache
from worker.kv_quant import FP8_DTYPES, FP8_MAX, dequantize, quantize

FP8_KINDS = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_each_vector_has_its_own_scale_and_reads_back_within_half_a_step(fp8):
    g = torch.Generator().manual_seed(0)
    # tokens x heads x head_dim, each vector at its own magnitude (1e-4 .. 1e4)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-4, 4, 150).view(50, 3, 1)
    x[7, 1] = 0  # a zero vector: scale 1, zeros
    values, scale = quantize(x, fp8)
    assert values.dtype == fp8 and values.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (50, 3)
    amax = x.abs().amax(-1)
    expected = torch.where(amax == 0, 1.0, amax / FP8_MAX[fp8])
    assert torch.equal(scale, expected)
    assert scale[7, 1] == 1 and not values[7, 1].float().any()
    # each vector's largest element is the format's largest value
    assert torch.equal(values.float().abs().amax(-1)[amax > 0],
                       torch.full_like(amax[amax > 0], FP8_MAX[fp8]))
    back = dequantize(values, scale, torch.float32)
    # normal FP8 values: within half a step (2^-(mantissa + 1) relative); the subnormals,
    # within half the smallest subnormal step, times the scale
    step = 2.0 ** -(MANTISSA_BITS[fp8] + 1)
    smallest = torch.tensor(1, dtype=torch.uint8).view(fp8).float().item()
    bound = torch.maximum(step * x.abs(), 0.5 * smallest * scale[..., None]) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()


def test_a_token_reads_back_the_same_whatever_its_neighbours():
    """The warm path's promise: a token's bytes depend on its own K alone, so one
    appended to a half-full block is stored as a prefill of the whole block stores it."""
    g = torch.Generator().manual_seed(1)
    block = torch.randn(16, 4, 32, generator=g)
    whole = quantize(block, torch.float8_e4m3fn)
    one_by_one = [quantize(block[i : i + 1], torch.float8_e4m3fn) for i in range(16)]
    assert torch.equal(whole[0].view(torch.uint8),
                       torch.cat([v for v, _ in one_by_one]).view(torch.uint8))
    assert torch.equal(whole[1], torch.cat([s for _, s in one_by_one]))


def test_the_tiers_hold_about_twice_the_tokens_of_bfloat16():
    """Per head: head_dim bytes and a 4-byte scale, against 2 * head_dim."""
    for head_dim, ratio in ((64, 128 / 68), (128, 256 / 132)):
        bf16 = KVCache.bytes_per_block(30, 16, 3, head_dim, torch.bfloat16)
        for fp8 in FP8_KINDS:
            b = KVCache.bytes_per_block(30, 16, 3, head_dim, fp8)
            assert b == 2 * 30 * 16 * 3 * (head_dim + 4)
            assert bf16 / b == pytest.approx(ratio)


def test_the_kv_dtype_is_resolved_from_the_flag():
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu, 64) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, cpu, 64) == torch.float32
    for name, dtype in FP8_DTYPES.items():
        assert resolve_kv_dtype(name, torch.bfloat16, cpu, 64) == dtype
    assert FP8_DTYPES["fp8"] == torch.float8_e4m3fn  # vLLM's meaning
    # a rank whose `auto` device is a GPU refuses, with the reason (nothing touches CUDA)
    with pytest.raises(StartupError, match="CPU only: FlashInfer takes FP8 KV with one scale"):
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda"), 64)
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cuda"), 64) == torch.bfloat16
