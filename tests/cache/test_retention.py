"""Retention (a client's cache_control): marked prefixes outlive unmarked blocks under
pressure, in both tiers, until their TTL has passed since their last use; a cap bounds
them; nothing about it changes a block's hash. The clock is fake."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import CacheConfig, KVCacheManager, make_extra_key
from cache.retention import RetainingLru, RetentionPolicy
from cache.state_host import DEAD, HELD, RETAINED

BS = 4
KEY = make_extra_key("m", None)
FIVE_MIN = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def mgr(clock: Clock, num_device_blocks: int = 16, num_host_blocks: int = 0,
        **kw) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS, num_device_blocks=num_device_blocks,
                                      num_host_blocks=num_host_blocks, **kw), clock=clock)


def serve(m: KVCacheManager, seq_id: int, tokens: list[int], step: int,
          retain: float = 0.0) -> list[int]:
    """A whole sequence in one step, closed the next; marked for `retain` s if asked."""
    blocks = m.allocate(seq_id, tokens, len(tokens), KEY)
    assert blocks is not None
    m.commit(seq_id, tokens, len(tokens), step)
    if retain:
        m.retain(seq_id, [(len(tokens), retain)])
    m.take_ops()
    m.free(seq_id, step + 1)
    m.check_invariants()
    return blocks


def cached_tokens(m: KVCacheManager, tokens: list[int]) -> int:
    return m.lookup(tokens + [0], KEY).num_tokens


def prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_marked_prefix_outlives_unmarked_blocks_under_pressure() -> None:
    clock = Clock()
    m = mgr(clock)  # 16 blocks
    session = prompt(16, 0)  # 4 blocks, marked
    serve(m, 1, session, 0, retain=FIVE_MIN)
    # a burst of one-off requests, 3 blocks each, newer than the session's blocks: under
    # plain LRU the session would be the first to go
    for i in range(8):
        clock.now += 10
        serve(m, 10 + i, prompt(12, 1000 * (i + 1)), 2 * i + 2)
    assert cached_tokens(m, session) == 16
    assert m.stats.num_device_retained_evictions == 0
    assert m.usage()["device"]["retained"] == 4


def test_retention_ends_a_ttl_after_the_last_use() -> None:
    clock = Clock()
    m = mgr(clock)
    session = prompt(16, 0)
    serve(m, 1, session, 0, retain=FIVE_MIN)
    clock.now += 200
    serve(m, 2, session + prompt(4, 500), 2)  # a use (unmarked itself) refreshes them
    clock.now += 200  # 400 s after the first use, 200 s after the last: still retained
    for i in range(6):
        serve(m, 10 + i, prompt(12, 1000 * (i + 1)), 4 + 2 * i)
    assert cached_tokens(m, session) == 16
    clock.now += FIVE_MIN  # the TTL has passed: ordinary LRU blocks, the oldest
    serve(m, 30, prompt(12, 50_000), 40)
    # they were the oldest: three are reused, the chain's tail first, so its head stays
    assert cached_tokens(m, session) == 4
    assert m.usage()["device"]["retained"] == 0
    assert m.stats.num_device_retained_evictions == 0  # expired, so not early


def test_cap_degrades_marked_blocks_to_lru_never_an_error() -> None:
    clock = Clock()
    m = mgr(clock, max_retained_fraction=0.25)  # at most 4 of the 16 blocks
    serve(m, 1, prompt(16, 0), 0, retain=FIVE_MIN)
    serve(m, 2, prompt(16, 100), 2, retain=FIVE_MIN)  # 4 more: over the cap
    assert m.usage()["device"]["retained"] == 4
    for i in range(4):
        serve(m, 10 + i, prompt(12, 1000 * (i + 1)), 4 + 2 * i)
    # the prefix that found the cap full fell back to LRU; the first one is still kept
    assert cached_tokens(m, prompt(16, 0)) == 16
    assert cached_tokens(m, prompt(16, 100)) < 16
    assert m.stats.num_device_retained_evictions == 0


def test_retained_blocks_go_last_even_before_their_ttl() -> None:
    """When nothing else is left, retained blocks are evicted (counted), never a refusal."""
    clock = Clock()
    m = mgr(clock, num_device_blocks=8, max_retained_fraction=1.0)
    serve(m, 1, prompt(32, 0), 0, retain=FIVE_MIN)  # all 8 blocks marked
    serve(m, 2, prompt(12, 5000), 2)  # needs 3 of them
    assert m.stats.num_device_retained_evictions == 3


def test_retention_follows_blocks_to_the_host_and_back() -> None:
    clock = Clock()
    m = mgr(clock, num_device_blocks=8, num_host_blocks=16)
    session = prompt(16, 0)  # 4 blocks, marked
    serve(m, 1, session, 0, retain=FIVE_MIN)
    # one-offs of 7 blocks: the first finds nothing else to evict on the device, so 3 of
    # the session's blocks go early (counted), written back to the host with their
    # retention; the later ones fill the host, where those 3 must not be evicted
    for i in range(6):
        clock.now += 5
        serve(m, 10 + i, prompt(28, 1000 * (i + 1)), 2 + 2 * i)
    assert m.stats.num_device_retained_evictions == 3
    assert m.stats.num_host_evictions > 0 and m.stats.num_host_retained_evictions == 0
    assert m.lookup(session + [0], KEY).num_tokens == 16
    assert m.usage()["host"]["retained"] == 3
    # a hit swaps them in: the device blocks keep the host slots' retention
    serve(m, 2, session + prompt(4, 500), 20)
    assert m.device.lru.ttl_s[m.device.index.find(*_keys(m, session))].min() == FIVE_MIN


def test_a_state_snapshot_is_worth_what_its_blocks_kv_is_in_any_tier() -> None:
    """The value a hybrid model's state slots evict by (cache/state_host.py): retained
    where a tier retains the block (here three on the host, one on the device), held where
    one caches it plainly, dead where none has it; retained no more once the TTL passed."""
    clock = Clock()
    m = mgr(clock, num_device_blocks=8, num_host_blocks=16)
    session = prompt(16, 0)
    serve(m, 1, session, 0, retain=FIVE_MIN)
    for i in range(6):
        serve(m, 10 + i, prompt(28, 1000 * (i + 1)), 2 + 2 * i)
    one_off, gone = prompt(28, 6000), prompt(28, 1000)  # the last and the first one-off
    assert m.usage()["host"]["retained"] == 3 and m.usage()["device"]["retained"] == 1
    assert m._chain_value(*_keys(m, session)).tolist() == [RETAINED] * 4
    assert m._chain_value(*_keys(m, one_off)).tolist() == [HELD] * 7
    assert DEAD in m._chain_value(*_keys(m, gone)).tolist()
    clock.now += FIVE_MIN + 1
    assert m._chain_value(*_keys(m, session)).tolist() == [HELD] * 4


def _keys(m: KVCacheManager, tokens: list[int]):
    from cache.hashing import BlockHashChain

    chain = BlockHashChain(BS, KEY)
    chain.extend(tokens, len(tokens) // BS)
    return chain.keys(0, len(tokens) // BS)


def test_markers_never_change_a_block_hash() -> None:
    """Retention is bookkeeping beside the index: a marked and an unmarked run of the
    same tokens register the same hashes, and each hits the other's blocks."""
    tokens = prompt(16, 7)
    clock = Clock()
    marked, plain = mgr(clock), mgr(clock)
    serve(marked, 1, tokens, 0, retain=FIVE_MIN)
    serve(plain, 1, tokens, 0)
    want = sorted(_keys(marked, tokens)[0].tolist())
    for m in (marked, plain):
        lo, _ = m.device.index.keys_of(np.arange(4, dtype=np.int32))
        assert sorted(lo.tolist()) == want
        assert cached_tokens(m, tokens) == 16


# --- the order itself, against a model ------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.lists(st.integers(0, 11), min_size=1, max_size=5,
                                        unique=True)),
    st.tuples(st.just("mark"), st.lists(st.integers(0, 11), min_size=1, max_size=5,
                                        unique=True), st.sampled_from([300.0, 3600.0])),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 11), max_size=4, unique=True)),
    st.tuples(st.just("pop"), st.integers(0, 4)),
    st.tuples(st.just("wait"), st.sampled_from([10.0, 301.0, 3601.0])),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([0.0, 0.25, 1.0]))
def test_pop_order_matches_a_model(ops, fraction) -> None:
    """Popped: plain entries oldest first; then retained ones, earliest expiry first.
    Retained: marked, used within their TTL, and within the cap at their push."""
    clock = Clock()
    q = RetainingLru(12, RetentionPolicy(fraction, clock))
    for op in ops:
        if op[0] == "push":
            ids = np.array(op[1], dtype=np.int32)
            q.touch(ids)
            q.push(ids)
        elif op[0] == "mark":
            q.mark(np.array(op[1], dtype=np.int32), op[2])
        elif op[0] == "remove":
            q.remove(np.array(op[1], dtype=np.int32))
        elif op[0] == "wait":
            clock.now += op[1]
        else:
            q.expire()
            plain = q.plain.order().tolist()
            # each TTL's queue in order of use; across them, the earliest expiry first
            retained = sorted(((float(q.until[x]), x) for r in q.retained.values()
                               for x in r.order().tolist()), key=lambda e: e[0])
            want = (plain + [x for _, x in retained])[: op[1]]
            assert all(until > clock.now for until, _ in retained)  # expire() did its job
            early = max(0, len(want) - len(plain))
            before = q.early_evictions
            assert q.pop(op[1]).tolist() == want
            assert q.early_evictions - before == early
        q.check()
        assert q.num_retained <= q.max_retained
