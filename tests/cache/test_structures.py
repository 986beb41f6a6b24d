"""HashIndex, LruQueue and FreeList against plain-Python models."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.free_list import FreeList
from cache.hash_index import HashIndex
from cache.lru import LruQueue

N = 40
# Few distinct low words, so home slots collide and probe runs get long.
KEYS = st.tuples(st.integers(0, 7), st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "clear"]),
                          st.lists(st.tuples(st.integers(0, N - 1), KEYS), max_size=12)),
                max_size=40))
def test_hash_index_matches_dict(ops) -> None:
    index = HashIndex(N)
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
        probe = [(a, b) for a in range(8) for b in range(4)]
        found = index.find(np.array([p[0] for p in probe], np.uint64),
                           np.array([p[1] for p in probe], np.uint64))
        assert found.tolist() == [model.get(p, -1) for p in probe]


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


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop"]),
                          st.lists(st.integers(0, 9), max_size=6, unique=True),
                          st.integers(0, 5), st.booleans()),
                max_size=60))
def test_lru_matches_ordered_dict(ops) -> None:
    lru = LruQueue(10)
    model: OrderedDict[int, None] = OrderedDict()
    skip = np.zeros(10, dtype=bool)
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
