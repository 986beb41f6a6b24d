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
