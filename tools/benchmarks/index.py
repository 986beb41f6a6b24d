"""Prefix-index scale benchmark, no model: memory per cached block and match time.

Fills a KVCacheManager to the deployment's capacity (57M device-tier tokens, 617M
host-tier tokens, 16-token blocks: 3.56M device blocks + 38.6M host slots) and times
matching a 450,000-token prompt (28,125 blocks): a device hit, a host hit and a miss.

The fill uses `KVCacheManager.preload` (random 128-bit hashes, bulk-inserted into the
same structures the scheduler uses): registering 42M blocks through allocate/commit
would spend minutes hashing made-up tokens and measure nothing more. The three probe
prompts are real token lists whose real hash chains are preloaded.

    python -m tools.benchmarks.index               # full scale (~2.5 GB RSS)
    python -m tools.benchmarks.index --scale 0.1   # a fraction; per-block figures carry over
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from cache import BlockHashChain, CacheConfig, KVCacheManager, make_extra_key
from cache.hashing import pack_tokens

TARGET_BYTES_PER_BLOCK = 100
TARGET_MATCH_MS = 5.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def fill(mgr: KVCacheManager, tier: str, n_random: int, probe: BlockHashChain,
         rng: np.random.Generator, chunk: int = 1 << 22) -> None:
    """Preload ``n_random`` random hashes, then the probe prompt's chain (most recent)."""
    for start in range(0, n_random, chunk):
        k = min(chunk, n_random - start)
        lo = rng.integers(0, 2**64, k, dtype=np.uint64)
        hi = rng.integers(0, 2**64, k, dtype=np.uint64)
        mgr.preload(tier, lo, hi)
    lo, hi = probe.keys()
    mgr.preload(tier, lo, hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of full capacity")
    ap.add_argument("--device-tokens", type=float, default=57e6)
    ap.add_argument("--host-tokens", type=float, default=617e6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=450_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    bs = args.block_size
    n_dev = int(args.device_tokens * args.scale) // bs
    n_host = int(args.host_tokens * args.scale) // bs
    n_prompt_blocks = args.prompt_tokens // bs
    assert n_dev > n_prompt_blocks + 1 and n_host > n_prompt_blocks, "scale too small"
    rng = np.random.default_rng(args.seed)
    key = make_extra_key("bench-model", None)
    # Three prompts (+1 token, so the hit cap keeps every full block): A lives in the
    # device tier, B in the host tier, C nowhere.
    prompts = {name: rng.integers(0, 150_000, args.prompt_tokens + 1).tolist()
               for name in ("A", "B", "C")}
    chains = {}
    for name, toks in prompts.items():
        chains[name] = BlockHashChain(bs, key)
        chains[name].extend(toks)

    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    mgr = KVCacheManager(CacheConfig(block_size=bs, num_device_blocks=n_dev,
                                     num_host_blocks=n_host))
    fill(mgr, "device", n_dev - n_prompt_blocks, chains["A"], rng)
    fill(mgr, "host", n_host - n_prompt_blocks, chains["B"], rng)
    fill_s = time.perf_counter() - t0
    gc.collect()
    traced, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = rss_bytes()
    n_blocks = n_dev + n_host
    usage = mgr.usage()
    assert usage["device"]["cached"] == n_dev and usage["host"]["cached"] == n_host
    allocated = mgr.device.nbytes() + mgr.host.nbytes()

    # --- timings -----------------------------------------------------------------------
    r = args.repeat
    toks_a = prompts["A"]
    t_pack = median_ms(lambda: pack_tokens(toks_a), r)
    t_hash = median_ms(lambda: BlockHashChain(bs, key).extend(toks_a), r)
    nd = np.asarray(toks_a, dtype=np.int64)
    t_hash_np = median_ms(lambda: BlockHashChain(bs, key).extend(nd), r)
    expect = {"A": (n_prompt_blocks * bs, 0), "B": (0, n_prompt_blocks * bs), "C": (0, 0)}
    t_lookup, t_e2e = {}, {}
    for name, toks in prompts.items():
        hit = mgr.lookup(toks, key, chain=chains[name])
        assert (hit.num_device_tokens, hit.num_host_tokens) == expect[name], (name, hit)
        t_lookup[name] = median_ms(lambda t=toks, c=chains[name]: mgr.lookup(t, key, c), r)
        t_e2e[name] = median_ms(lambda t=toks: mgr.lookup(t, key), r)

    # A session's next request: the same conversation plus a new 2K-token turn. The
    # caller checked the old tokens are a prefix, so only the new blocks are hashed.
    toks_next = toks_a + rng.integers(0, 150_000, 2048).tolist()
    n_old = len(toks_a) // bs

    def next_turn() -> None:
        chain = chains["A"].prefix(n_old)
        chain.extend(toks_next)
        hit = mgr.lookup(toks_next, key, chain)
        assert hit.num_device_tokens == n_old * bs

    t_next = median_ms(next_turn, r)

    def alloc_free_a() -> None:
        assert mgr.allocate(1, toks_a, len(toks_a), key, chain=chains["A"]) is not None
        mgr.free(1, 0)  # rolled back in the same step: allowed, no commit happened

    t_alloc_a = median_ms(alloc_free_a, r)
    t = time.perf_counter()
    assert mgr.allocate(2, prompts["B"], len(prompts["B"]), key, chain=chains["B"])
    t_alloc_b = 1e3 * (time.perf_counter() - t)
    ops = mgr.peek_ops()
    mgr.free(2, 0)
    mgr.take_ops()

    # --- report ------------------------------------------------------------------------
    per_block_rss = (rss1 - rss0) / n_blocks
    per_block_alloc = allocated / n_blocks
    per_block_traced = traced / n_blocks
    e2e_hit = t_e2e["A"]
    ok = "ok"
    rows = [
        ("scale", f"{args.scale:g}", f"{n_dev:,} device blocks + {n_host:,} host slots", ""),
        ("fill time", f"{fill_s:.1f} s", "bulk preload (vectorised insert)", ""),
        ("memory / block (RSS delta)", f"{per_block_rss:.1f} B",
         f"{(rss1 - rss0) / 2**30:.2f} GiB", TARGET_BYTES_PER_BLOCK),
        ("memory / block (allocated)", f"{per_block_alloc:.1f} B",
         "all arrays fully touched (steady state)", TARGET_BYTES_PER_BLOCK),
        ("memory / block (tracemalloc)", f"{per_block_traced:.1f} B",
         f"peak during fill {traced_peak / n_blocks:.1f} B", TARGET_BYTES_PER_BLOCK),
        ("pack 450K tokens (list->bytes)", f"{t_pack:.2f} ms", "", ""),
        ("hash 28,125 blocks (list in)", f"{t_hash:.2f} ms", "incl. pack", ""),
        ("hash 28,125 blocks (numpy in)", f"{t_hash_np:.2f} ms", "", ""),
        ("lookup, hashes known: device hit", f"{t_lookup['A']:.2f} ms", "", TARGET_MATCH_MS),
        ("lookup, hashes known: host hit", f"{t_lookup['B']:.2f} ms", "", TARGET_MATCH_MS),
        ("lookup, hashes known: miss", f"{t_lookup['C']:.2f} ms", "", TARGET_MATCH_MS),
        ("match incl. hashing: device hit", f"{t_e2e['A']:.2f} ms", "", TARGET_MATCH_MS),
        ("match incl. hashing: host hit", f"{t_e2e['B']:.2f} ms", "", TARGET_MATCH_MS),
        ("match incl. hashing: miss", f"{t_e2e['C']:.2f} ms", "stops at first miss",
         TARGET_MATCH_MS),
        ("match, next turn of a session", f"{t_next:.2f} ms",
         "450K known + 2K new tokens: hash 128 blocks", TARGET_MATCH_MS),
        ("allocate+free, 28K device hit", f"{t_alloc_a:.2f} ms", "refcounts + LRU", ""),
        ("allocate, 28K host hit", f"{t_alloc_b:.1f} ms",
         f"{len(ops.swap_in):,} swap_in, {len(ops.swap_out):,} swap_out", ""),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'metric':<{w0}}  {'value':>{w1}}  {'target':>8}  note")
    print("-" * (w0 + w1 + 40))
    for name, value, note, target in rows:
        if target == "":
            tcol = ""
        else:
            num = float(value.split()[0])
            tcol = f"<{target:g}" + (" ok" if num < target else " MISS")
            ok = ok if num < target else "miss"
        print(f"{name:<{w0}}  {value:>{w1}}  {tcol:>8}  {note}")
    print()
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.1f} during the run (times are medians "
          f"of {r}; a busy machine inflates them).")
    if args.scale != 1.0:
        print(f"Scaled run ({args.scale:g}): per-block memory is scale-free up to the power-of-"
              "two table rounding; match time does not depend on the fill (hash lookups).")
    if e2e_hit >= TARGET_MATCH_MS:
        print(f"Matching a never-seen 450K-token prompt misses the {TARGET_MATCH_MS:g} ms "
              f"target because of hashing: a blake2b call per block costs "
              f"~{1e3 * t_hash / n_prompt_blocks:.2f} us in CPython ({t_hash:.0f} ms for "
              f"28,125 blocks; measured here, about half is the Python loop and calls, the "
              f"rest the blake2b compression), while the index lookup takes "
              f"{t_lookup['A']:.1f} ms. The design "
              "hashes a sequence once in its life (BlockHashChain, extended as tokens arrive "
              "and passed to lookup/allocate), stops hashing at the first miss, and lets a "
              "session's next request hash only its new turn (chain.prefix(k)).")
    if max(t_lookup.values()) >= TARGET_MATCH_MS:
        print("A host-tier hit runs two index passes (device first, per block, then host for "
              "the device misses) over 28,125 keys; each pass is a few rounds of ~10 numpy "
              "calls over random-access arrays of 0.1-1 GB, bound by memory latency and "
              "numpy overhead on this machine.")
    print("Memory per block: 16 B hash + 4 B index slot + 8 B table entries at <= 30% "
          "load (27-38 B) + LRU links (2 x 4 B) and push stamp (8 B) + free stack (4 B) + "
          "flags; device blocks add a 4 B refcount. No per-block Python object.")


if __name__ == "__main__":
    main()
