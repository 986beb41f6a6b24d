"""KVCache: new tokens land at block * block_size + offset, and the tier copies move
whole blocks exactly, on CPU and on CUDA (pinned host memory, a side stream, the
compute stream waiting per layer as the model does)."""

from __future__ import annotations

import pytest
import torch

from worker.kv_cache import KVCache

LAYERS, BLOCKS, HOST_SLOTS, BLOCK, KV_HEADS, HEAD_DIM = 3, 8, 6, 4, 2, 8
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
