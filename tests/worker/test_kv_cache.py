"""KVCache: new tokens land at block * block_size + offset, and the tier copies move
whole blocks exactly, on CPU and on CUDA (pinned host memory, a side stream, the
compute stream waiting per layer as the model does)."""

from __future__ import annotations

import random

import pytest
import torch

from worker import kv_cache
from worker.kv_cache import KVCache

LAYERS, BLOCKS, HOST_SLOTS, BLOCK, KV_HEADS, HEAD_DIM = 3, 8, 8, 4, 2, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def make_cache(device: str) -> KVCache:
    cache = KVCache(LAYERS, BLOCKS, HOST_SLOTS, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16,
                    torch.device(device))
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(torch.bfloat16))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(torch.bfloat16))
    return cache


def slots_of(blocks: list[int]) -> torch.Tensor:
    return torch.tensor([b * BLOCK + o for b in blocks for o in range(BLOCK)])


@pytest.mark.parametrize("device", DEVICES)
def test_write_puts_each_token_at_its_slot(device):
    cache = make_cache(device)
    k = torch.randn(3, KV_HEADS, HEAD_DIM).to(torch.bfloat16).to(device)
    v = -k
    slots = torch.tensor([2 * BLOCK + 3, 5 * BLOCK, 5 * BLOCK + 1], device=device)
    cache.write(1, k, v, slots)
    assert torch.equal(cache.k[1, 2, 3], k[0]) and torch.equal(cache.v[1, 5, 1], v[2])
    assert torch.equal(cache.k[1, 5, 0], k[1])


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_in_round_trips_blocks_exactly(device):
    cache = make_cache(device)
    if device == "cuda":
        assert cache.k_host.is_pinned() and cache.v_host.is_pinned()
    k0, v0 = cache.k.clone(), cache.v.clone()

    # Step 1: blocks 1 and 5 go out to host slots 0 and 3, and the same step's forward
    # writes new tokens into both blocks (the scheduler reuses an evicted block at
    # once). Work queued first on the compute stream makes the side stream's copies
    # start late, so a missing wait would let the new tokens overtake them.
    if device == "cuda":
        x = torch.randn(4096, 4096, device=device)
        for _ in range(4):
            x = x @ x / 64
    cache.swap([(1, 0), (5, 3)], [])
    zeros = torch.zeros(2 * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    for layer in range(LAYERS):
        cache.wait_layer(layer)
        cache.write(layer, zeros, zeros, slots_of([1, 5]).to(device))

    # Step 2: block 3 goes out to slot 5 and, in the same step, slot 5 comes back into
    # block 6 (swap_out first: block 6 must get block 3); slots 0 and 3 come back into
    # blocks 2 and 7.
    cache.swap([(3, 5)], [(0, 2), (3, 7), (5, 6)])
    for layer in range(LAYERS):
        cache.wait_layer(layer)
    if device == "cuda":
        torch.cuda.synchronize()

    for src, dst in ((1, 2), (5, 7), (3, 6)):
        assert torch.equal(cache.k[:, dst], k0[:, src]), f"block {src} -> {dst}"
        assert torch.equal(cache.v[:, dst], v0[:, src]), f"block {src} -> {dst}"
    for slot, src in ((0, 1), (3, 5), (5, 3)):
        assert torch.equal(cache.k_host[:, slot], k0[:, src].cpu()), f"slot {slot}"
        assert torch.equal(cache.v_host[:, slot], v0[:, src].cpu()), f"slot {slot}"
    for untouched in (0, 3, 4):
        assert torch.equal(cache.k[:, untouched], k0[:, untouched])
    assert not cache.k[:, [1, 5]].any() and not cache.v[:, [1, 5]].any()


@pytest.mark.parametrize("staging", [kv_cache.STAGING_BLOCKS, 2])
def test_batched_swaps_move_what_the_plain_copies_move(staging, monkeypatch):
    # The CUDA path (`_swap_by_layer`: gather, one copy per run of host slots, scatter)
    # runs on the CPU as well: over random steps it must leave both tiers as the CPU's
    # own fancy-index copies do, runs of consecutive slots and scattered ones alike, and
    # in chunks of `staging` blocks.
    monkeypatch.setattr(kv_cache, "STAGING_BLOCKS", staging)
    rng = random.Random(5)
    batched, plain = make_cache("cpu"), make_cache("cpu")
    layers_done = []
    for step in range(40):
        blocks = rng.sample(range(BLOCKS), rng.randint(0, 5))
        if step % 2:  # consecutive slots, as a fresh host tier hands them out
            first = rng.randrange(HOST_SLOTS - len(blocks) + 1)
            slots = list(range(first, first + len(blocks)))
        else:
            slots = rng.sample(range(HOST_SLOTS), len(blocks))
        swap_out = list(zip(blocks, slots))
        swap_in = list(zip(rng.sample(range(HOST_SLOTS), k := rng.randint(0, 4)),
                           rng.sample(range(BLOCKS), k)))
        batched._swap_by_layer(swap_out, swap_in, lambda s=step: layers_done.append(s))
        plain._swap_cpu(swap_out, swap_in)
        for ours, theirs in ((batched.k, plain.k), (batched.v, plain.v),
                             (batched.k_host, plain.k_host), (batched.v_host, plain.v_host)):
            assert torch.equal(ours, theirs), step
    assert layers_done == [s for s in range(40) for _ in range(LAYERS)]


def test_slot_runs():
    cache = make_cache("cpu")
    blocks, runs = cache._moves([(0, 2), (2, 7), (3, 6), (4, 0), (5, 1)])  # (slot, block)
    assert blocks.tolist() == [2, 7, 6, 0, 1]
    assert runs == [(0, 0, 1), (1, 2, 4)]  # (first staging row, first slot, count)
    assert cache._moves([])[1] == []


@pytest.mark.cuda
def test_cuda_swaps_are_batched_per_layer_not_block_by_block():
    """Eight blocks out to consecutive host slots and eight back in: per layer one
    device-to-host copy for K and one for V, and as many the other way (block by block
    it would be 16 each way), and the blocks arrive whole."""
    from torch.profiler import ProfilerActivity, profile

    cache = make_cache("cuda")
    k0 = cache.k.clone()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache.swap([(b, b) for b in range(BLOCKS)], [])
        cache.sync_copies()
        cache.swap([], [(s, BLOCKS - 1 - s) for s in range(BLOCKS)])
        cache.sync_copies()
    names = [e.name for e in prof.events() if e.name.startswith("Memcpy")]  # on the device
    assert sum("DtoH" in n for n in names) == 2 * LAYERS, names
    assert sum("HtoD" in n for n in names) == 2 * LAYERS + 2, names  # + each swap's index
    assert all("Pinned" in n for n in names), names  # async copies: nothing pageable
    for b in range(BLOCKS):
        assert torch.equal(cache.k[:, BLOCKS - 1 - b], k0[:, b])


# --- FP8 KV: the scales are part of the block, in every tier and every copy ------------

FP8_KINDS = [torch.float8_e4m3fn, torch.float8_e5m2]


def make_fp8_cache(fp8: torch.dtype, host_slots: int = HOST_SLOTS) -> KVCache:
    """Every slot of the device tier written (random K/V at random magnitudes)."""
    cache = KVCache(LAYERS, BLOCKS, host_slots, BLOCK, KV_HEADS, HEAD_DIM, fp8,
                    torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(BLOCKS * BLOCK)
    for layer in range(LAYERS):
        size = torch.logspace(-3, 3, len(slots) * KV_HEADS).view(-1, KV_HEADS, 1)
        k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g) * size
        cache.write(layer, k, -2 * k, slots)
    return cache


def parts(cache: KVCache, host: bool = False) -> list[torch.Tensor]:
    """The tier's K, V (as bytes) and scales, for exact comparisons."""
    if host:
        return [cache.k_host.view(torch.uint8), cache.v_host.view(torch.uint8),
                cache.k_scale_host, cache.v_scale_host]
    return [cache.k.view(torch.uint8), cache.v.view(torch.uint8), cache.k_scale, cache.v_scale]


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_fp8_write_stores_each_tokens_values_and_scales_at_its_slot(fp8):
    from worker.kv_quant import quantize

    cache = KVCache(LAYERS, BLOCKS, 0, BLOCK, KV_HEADS, HEAD_DIM, fp8, torch.device("cpu"))
    assert cache.k.dtype == fp8 and cache.k_scale.shape == (LAYERS, BLOCKS, BLOCK, KV_HEADS)
    k = torch.randn(3, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    slots = torch.tensor([2 * BLOCK + 3, 5 * BLOCK, 5 * BLOCK + 1])
    cache.write(1, k, -k, slots)
    values, scales = quantize(k, fp8)
    for i, (block, offset) in enumerate([(2, 3), (5, 0), (5, 1)]):
        assert torch.equal(cache.k[1, block, offset].view(torch.uint8),
                           values[i].view(torch.uint8))
        assert torch.equal(cache.k_scale[1, block, offset], scales[i])
        assert torch.equal(cache.v_scale[1, block, offset], scales[i])  # |-k| = |k|
    k_scale, v_scale = cache.scales(1)  # views of the layer's scales, as the kernels take
    assert k_scale.data_ptr() == cache.k_scale[1].data_ptr() and k_scale.shape == (
        BLOCKS, BLOCK, KV_HEADS) and v_scale.data_ptr() == cache.v_scale[1].data_ptr()
    plain = KVCache(LAYERS, BLOCKS, 0, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16,
                    torch.device("cpu"))
    assert plain.scales(1) == (None, None) and plain.k_scale is None


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_fp8_swaps_move_the_scales_with_their_blocks(fp8):
    """Out to the host tier and back into other blocks: values and scales arrive whole."""
    cache = make_fp8_cache(fp8)
    before = [p.clone() for p in parts(cache)]
    cache.swap([(1, 0), (5, 3)], [])
    for dev, host in zip(before, parts(cache, host=True)):
        assert torch.equal(host[:, 0], dev[:, 1]) and torch.equal(host[:, 3], dev[:, 5])
    cache.swap([(3, 5)], [(0, 2), (3, 7), (5, 6)])
    for old, now in zip(before, parts(cache)):
        for src, dst in ((1, 2), (5, 7), (3, 6)):
            assert torch.equal(now[:, dst], old[:, src]), f"block {src} -> {dst}"
        for untouched in (0, 1, 3, 4, 5):
            assert torch.equal(now[:, untouched], old[:, untouched])


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_fp8_batched_swaps_move_what_the_plain_copies_move(fp8, monkeypatch):
    """The CUDA path's gather and scatter, run on the CPU, against the CPU's own copies
    (as test_batched_swaps_move_what_the_plain_copies_move does for 16-bit KV): scales
    included, in chunks of 2."""
    monkeypatch.setattr(kv_cache, "STAGING_BLOCKS", 2)
    rng = random.Random(6)
    batched, plain = make_fp8_cache(fp8), make_fp8_cache(fp8)
    for step in range(30):
        blocks = rng.sample(range(BLOCKS), rng.randint(0, 5))
        swap_out = list(zip(blocks, rng.sample(range(HOST_SLOTS), len(blocks))))
        swap_in = list(zip(rng.sample(range(HOST_SLOTS), k := rng.randint(0, 4)),
                           rng.sample(range(BLOCKS), k)))
        batched._swap_by_layer(swap_out, swap_in)
        plain._swap_cpu(swap_out, swap_in)
        for host in (False, True):
            for ours, theirs in zip(parts(batched, host), parts(plain, host)):
                assert torch.equal(ours, theirs), step


@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_fp8_host_slot_bytes_are_the_whole_block(fp8):
    """A disk record's payload: K, V and their scales, sized as the block is budgeted, and
    loaded back into another slot bit for bit."""
    cache = make_fp8_cache(fp8, host_slots=2)
    cache.swap([(4, 0)], [])
    payload = cache.host_slot_bytes(0)
    assert len(payload) == cache.host_slot_nbytes() == KVCache.bytes_per_block(
        LAYERS, BLOCK, KV_HEADS, HEAD_DIM, fp8)
    cache.load_host_slot(1, payload)
    for host in parts(cache, host=True):
        assert torch.equal(host[:, 1], host[:, 0])
    with pytest.raises(AssertionError, match="payload"):
        cache.load_host_slot(1, payload + b"\0" * 8)
