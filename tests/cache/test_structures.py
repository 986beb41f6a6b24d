"""HashIndex, LruQueue and FreeList against plain-Python models."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.free_list import FreeList
from cache.hash_index import HashIndex
from cache.lru import LruQueue

N = 40  # a 256-slot table
# Few distinct low words, so home slots collide and probe runs get long; some homes at
# the end of the table, so runs wrap around; 257 and 766 share homes with 1 and 254.
LOS = [0, 1, 2, 3, 252, 253, 254, 255, 257, 766]
KEYS = st.tuples(st.sampled_from(LOS), st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "clear"]),
                          st.lists(st.tuples(st.integers(0, N - 1), KEYS), max_size=12)),
                max_size=40))
def test_hash_index_matches_dict(ops) -> None:
    index = HashIndex(N)
    assert index.table_size == 256
    model: dict[tuple[int, int], int] = {}
    for op, batch in ops:
        if op == "clear":
            index.clear()
            model.clear()
        elif op == "insert":
            items, keys, seen_i, seen_k = [], [], set(), set()
            for item, key in batch:
                if item in model.values() or key in model or item in seen_i or key in seen_k:
                    continue
                seen_i.add(item)
                seen_k.add(key)
                items.append(item)
                keys.append(key)
            lo = np.array([k[0] for k in keys], np.uint64)
            hi = np.array([k[1] for k in keys], np.uint64)
            index.insert(np.array(items, np.int32), lo, hi)
            model.update(zip(keys, items))
        else:
            inv = {v: k for k, v in model.items()}
            items = sorted({i for i, _ in batch if i in inv})
            index.remove(np.array(items, np.int32))
            for i in items:
                del model[inv[i]]
        index.check()
        probe = [(a, b) for a in LOS for b in range(4)]
        want = [model.get(p, -1) for p in probe]
        lo = np.array([p[0] for p in probe], np.uint64)
        hi = np.array([p[1] for p in probe], np.uint64)
        assert index.find(lo, hi).tolist() == want  # few queries: window rounds
        # A handful at a time (a decode step's new blocks): the scalar probes
        for i in range(0, len(probe), 7):
            assert index.find(lo[i:i + 7], hi[i:i + 7]).tolist() == want[i:i + 7]
        # Many queries: flat rounds first. All these keys share one tag, so every probe
        # compares full keys and tag matches with other keys must be passed over.
        assert index.find(np.tile(lo, 20), np.tile(hi, 20)).tolist() == want * 20


def test_hash_index_full_capacity_with_churn() -> None:
    rng = np.random.default_rng(0)
    n = 1000
    index = HashIndex(n)
    lo = rng.integers(0, 2**64, n, dtype=np.uint64)
    hi = rng.integers(0, 2**64, n, dtype=np.uint64)
    index.insert(np.arange(n, dtype=np.int32), lo, hi)
    for _ in range(50):  # churn forces tombstone reuse and rebuilds
        items = rng.choice(n, 100, replace=False).astype(np.int32)
        index.remove(items)
        lo[items] = rng.integers(0, 2**64, 100, dtype=np.uint64)
        index.insert(items, lo[items], hi[items])
    index.check()
    assert (index.find(lo, hi) == np.arange(n)).all()
    assert (index.find(lo + np.uint64(1), hi) == -1).all()


def test_hash_index_mass_removal_takes_the_vectorised_path() -> None:
    rng = np.random.default_rng(1)
    n = 20_000
    index = HashIndex(n)
    lo = rng.integers(0, 2**64, n, dtype=np.uint64)
    hi = rng.integers(0, 2**64, n, dtype=np.uint64)
    index.insert(np.arange(n, dtype=np.int32), lo, hi)
    gone = rng.choice(n, 12_000, replace=False).astype(np.int32)  # > 4096: re-placement
    index.remove(gone)
    index.check()
    want = np.arange(n)
    want[gone] = -1
    assert (index.find(lo, hi) == want).all()


@settings(max_examples=150, deadline=None)
# Batches of up to 8 ids take the plain-int path (cache/lru.py `_FEW`), longer ones the
# vectorised one: both, interleaved, against one model.
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop"]),
                          st.lists(st.integers(0, 19), max_size=16, unique=True),
                          st.integers(0, 12), st.booleans()),
                max_size=60))
def test_lru_matches_ordered_dict(ops) -> None:
    lru = LruQueue(20)
    model: OrderedDict[int, None] = OrderedDict()
    skip = np.zeros(20, dtype=bool)
    skip[[2, 5]] = True
    for op, ids, k, use_skip in ops:
        if op == "push":
            lru.push(np.array(ids, np.int32))
            for i in ids:
                model.pop(i, None)
                model[i] = None
        elif op == "remove":
            lru.remove(np.array(ids, np.int32))
            for i in ids:
                model.pop(i, None)
        else:
            got = lru.pop(k, skip=skip if use_skip else None).tolist()
            order = list(model)
            if use_skip:
                want, passed = [], []
                for i in order:
                    if len(want) == k:
                        break
                    (passed if skip[i] else want).append(i)
                for i in want + passed:
                    model.pop(i)
                for i in passed:
                    model[i] = None
            else:
                want = order[:k]
                for i in want:
                    model.pop(i)
            assert got == want
        lru.check()
        assert lru.order().tolist() == list(model)


def test_free_list_order_and_double_free() -> None:
    fl = FreeList(5)
    assert fl.pop(2).tolist() == [0, 1]
    fl.push(np.array([1, 0], np.int32))
    assert fl.pop(3).tolist() == [1, 0, 2]
    try:
        fl.push(np.array([3], np.int32))
    except AssertionError:
        return
    raise AssertionError("double free not detected")


def test_device_pool_never_evicts_busy_blocks() -> None:
    from cache.block_pool import DevicePool

    pool = DevicePool(3)
    blocks, _, _, _ = pool.take(3)
    keys = np.arange(3, dtype=np.uint64)
    pool.register(blocks, keys, keys)
    pool.mark_busy(blocks[:1])  # the oldest in the LRU below
    pool.unref(blocks)
    assert pool.num_evictable() == 2
    got, evicted, _, _ = pool.take(2)
    assert sorted(got.tolist()) == sorted(blocks[1:].tolist()) == sorted(evicted.tolist())
    pool.clear_busy()
    assert pool.take(1)[0].tolist() == blocks[:1].tolist()
    pool.check()


def test_hash_index_delete_in_a_run_that_wraps_around() -> None:
    # Homes 254, 254, 254, 255, 0 in a 256-slot table: one probe run over the end.
    los = np.array([254, 254 + 256, 254 + 512, 255, 256], np.uint64)
    his = np.arange(5, dtype=np.uint64)
    for victim in range(5):
        index = HashIndex(N)
        for i in range(5):  # one at a time: a known layout, 254 255 0 1 2
            index.insert(np.array([i], np.int32), los[i:i + 1], his[i:i + 1])
        index.remove(np.array([victim], np.int32))
        index.check()
        want = [-1 if i == victim else i for i in range(5)]
        assert index.find(los, his).tolist() == want
