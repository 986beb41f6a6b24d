"""KVCacheManager scenarios: sharing, closing, eviction to host and back, policies."""

from __future__ import annotations

import pytest

from cache import CacheConfig, KVCacheManager, PrefixHit, make_extra_key
from tests.cache.digest import block_hashes, digest_state

BS = 4
KEY = make_extra_key("m", None)


def mgr(num_device_blocks: int = 16, num_host_blocks: int = 0, **kw) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS, num_device_blocks=num_device_blocks,
                                      num_host_blocks=num_host_blocks, **kw))


def run(m: KVCacheManager, seq_id: int, tokens: list[int], step: int = 0) -> list[int]:
    """Admit a whole prompt in one step and commit it."""
    blocks = m.allocate(seq_id, tokens, len(tokens), KEY)
    assert blocks is not None
    m.commit(seq_id, tokens, len(tokens), step)
    m.check_invariants()
    return blocks


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_hit_shares_blocks_and_caps_at_last_token() -> None:
    m = mgr()
    p = prompt(16)  # exactly 4 full blocks
    a = run(m, 1, p)
    assert m.lookup(p, KEY) == PrefixHit(12, 0)  # the last block is recomputed
    b = run(m, 2, p + [99])
    assert b[:4] == a[:4]  # 4 full blocks hit (17 tokens -> cap 4)
    assert m.num_cached_tokens(2) == PrefixHit(16, 0)
    assert m.device.refcount[a[:4]].tolist() == [2, 2, 2, 2]
    m.take_ops()
    m.free(1, 1)  # still referenced by seq 2
    m.check_invariants()
    assert m.device.refcount[a[:4]].tolist() == [1, 1, 1, 1]
    assert m.usage()["device"] == {"capacity": 16, "used": 5, "cached": 0, "free": 11,
                                     "retained": 0, "retained_tokens": 0}
    m.free(2, 1)
    m.check_invariants()
    u = m.usage()["device"]
    assert u["used"] == 0 and u["cached"] == 4 and u["cached"] + u["free"] == 16


def test_hit_on_live_blocks_of_another_sequence_in_the_same_step() -> None:
    m = mgr()
    p = prompt(12)
    a = run(m, 1, p)
    # Same step: seq 1's blocks are committed (KV written by this step's forward).
    b = m.allocate(2, p + [7, 8], 14, KEY)
    assert b[:3] == a[:3] and m.num_cached_tokens(2) == PrefixHit(12, 0)
    m.commit(2, p + [7, 8], 14, 0)
    m.check_invariants()


def test_duplicate_content_is_indexed_once() -> None:
    m = mgr()
    p = prompt(8)
    a = m.allocate(1, p, 8, KEY)
    b = m.allocate(2, p, 8, KEY)  # nothing committed yet: no hit, own blocks
    assert set(a).isdisjoint(b)
    m.commit(1, p, 8, 0)
    m.commit(2, p, 8, 0)
    m.commit(2, p, 8, 0)  # idempotent
    m.check_invariants()
    assert sorted(digest_state(m).device_map()) == sorted(a)
    m.take_ops()
    m.free(1, 1)
    m.free(2, 1)
    m.check_invariants()
    assert m.usage()["device"]["cached"] == 2  # b's copies went back to the free list


def test_allocate_is_atomic_when_full() -> None:
    m = mgr(num_device_blocks=4)
    run(m, 1, prompt(12))
    m.take_ops()
    before = (m.usage(), digest_state(m).fingerprint(), m.peek_ops())
    assert m.allocate(2, prompt(12, 100), 12, KEY) is None
    assert not m.has_seq(2)
    assert m.allocate(1, prompt(20), 20, KEY) is None
    assert (m.usage(), digest_state(m).fingerprint(), m.peek_ops()) == before
    assert m.allocate(1, prompt(16), 16, KEY) == [3]
    m.check_invariants()


def test_growing_sequence_registers_blocks_as_they_fill() -> None:
    m = mgr()
    toks = prompt(6)
    assert len(run(m, 1, toks)) == 2
    for step, t in enumerate(range(6, 13), start=1):
        m.take_ops()
        toks.append(t)
        m.allocate(1, toks, len(toks), KEY)
        m.commit(1, toks, len(toks), step)
        m.check_invariants()
    assert len(m.block_table(1)) == 4
    assert len(digest_state(m).device_map()) == 3  # 13 tokens: 3 full blocks


def _grown_pair() -> list[KVCacheManager]:
    """Two managers in the same state: three sequences of 5 tokens whose cached
    predecessors fill the rest of the device tier (so growing them evicts to the host)."""
    out = []
    for _ in range(2):
        m = mgr(num_device_blocks=8, num_host_blocks=16)
        run(m, 9, prompt(8, 500))  # 2 blocks, cached once freed: evicted by the growth
        m.take_ops()
        m.free(9, 1)
        for seq_id in (1, 2, 3):
            run(m, seq_id, prompt(5, 100 * seq_id), step=1)
        m.take_ops()
        out.append(m)
    return out


def test_grow_gives_what_allocating_one_by_one_gives() -> None:
    one, batched = _grown_pair()
    needs = [(1, 9), (2, 5), (3, 12)]  # a block each for 1 and 3, both evicted ones
    seq = [one.allocate(s, prompt(n, 100 * s), n, KEY) for s, n in needs]
    assert batched.grow(needs) == seq == [[1], [], [0]]  # seq 9's, its tail first
    assert batched.peek_ops() == one.peek_ops() and len(one.peek_ops().swap_out) == 2
    assert [batched.block_table(s) for s in (1, 2, 3)] == [one.block_table(s) for s in (1, 2, 3)]
    assert digest_state(batched).fingerprint() == digest_state(one).fingerprint()
    batched.check_invariants()


def test_grow_is_all_or_nothing() -> None:
    _, m = _grown_pair()
    before = (m.usage(), digest_state(m).fingerprint(), m.peek_ops())
    assert m.grow([(1, 9), (2, 24)]) is None  # 1 + 4 blocks, 4 to be had
    assert (m.usage(), digest_state(m).fingerprint(), m.peek_ops()) == before
    assert [len(m.block_table(s)) for s in (1, 2)] == [2, 2]


def test_a_first_allocation_takes_a_budget_past_its_hit() -> None:
    m = mgr()
    p = prompt(16)
    run(m, 1, p)
    m.take_ops()
    # 16 tokens hit (4 blocks); a budget of 5 more: blocks for 21 of the 40 tokens
    blocks = m.allocate(2, p + prompt(24, 100), 40, KEY, budget=5)
    assert m.num_cached_tokens(2) == PrefixHit(16, 0) and len(blocks) == 6
    with pytest.raises(AssertionError):  # a live sequence grows by its tokens, not a budget
        m.allocate(2, p + prompt(24, 100), 40, KEY, budget=5)


def test_commit_many_registers_what_commits_one_by_one_register() -> None:
    # seqs 1 and 2 hold the same tokens (the second fills a block of a hash the first
    # registers in the same batch: it keeps its copy unindexed); 3 fills nothing new
    managers = [mgr(), mgr()]
    same, other = prompt(6), prompt(6, 50)
    for m in managers:
        for seq_id, toks in ((1, same), (2, same), (3, other)):
            assert m.allocate(seq_id, toks, 6, KEY) is not None
            m.commit(seq_id, toks, 6, 0)
        m.take_ops()
    grown = same + [7, 8, 9]
    commits = [(1, grown, 9), (2, grown, 9), (3, other, 6)]
    one, batched = managers
    for seq_id, toks, n in commits:
        one.allocate(seq_id, toks, n, KEY)
        one.commit(seq_id, toks, n, 1)
    for seq_id, toks, n in commits:
        batched.allocate(seq_id, toks, n, KEY)
    batched.commit_many(commits, 1)
    assert batched.peek_ops() == one.peek_ops() and len(one.peek_ops().registered) == 1
    assert digest_state(batched).fingerprint() == digest_state(one).fingerprint()
    batched.check_invariants()
    with pytest.raises(AssertionError, match="closed in step 1"):  # committed in step 1
        batched.free(3, 1)


def test_close_in_the_running_step_is_loud() -> None:
    m = mgr()
    run(m, 1, prompt(8))
    with pytest.raises(AssertionError, match="closed in step"):
        m.free(1, 0)
    m.take_ops()
    m.free(1, 1)  # the next step is fine
    # Rolling back an admission that was never committed is allowed in the same step.
    assert m.allocate(2, prompt(8, 50), 8, KEY) is not None
    m.free(2, 1)
    m.check_invariants()


def test_eviction_keeps_prefix_heads_longest() -> None:
    m = mgr(num_device_blocks=6)
    run(m, 1, prompt(16))  # 4 blocks
    m.take_ops()
    m.free(1, 1)
    run(m, 2, prompt(12, 100), step=1)  # needs 3 blocks: 2 free + 1 evicted, the tail of seq 1
    assert m.lookup(prompt(17), KEY) == PrefixHit(12, 0)
    assert m.stats.num_device_evictions == 1


def test_prefix_caching_disabled() -> None:
    m = mgr(num_host_blocks=8, enable_prefix_caching=False)
    p = prompt(16)
    a = run(m, 1, p)
    assert m.lookup(p, KEY) == PrefixHit(0, 0)
    b = run(m, 2, p)
    assert set(a).isdisjoint(b)
    m.take_ops()
    m.free(1, 1)
    m.free(2, 1)
    assert m.usage()["device"] == {"capacity": 16, "used": 0, "cached": 0, "free": 16,
                                     "retained": 0, "retained_tokens": 0}
    assert not digest_state(m).device_map() and not m.take_ops()


def test_salts_never_share_blocks() -> None:
    m = mgr()
    p = prompt(16)
    k1, k2 = make_extra_key("m", "a"), make_extra_key("m", "b")
    m.allocate(1, p, 16, k1)
    m.commit(1, p, 16, 0)
    assert m.lookup(p, k2) == PrefixHit(0, 0)
    assert m.lookup(p, k1) == PrefixHit(12, 0)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_evict_to_host_then_hit_from_host(policy: str) -> None:
    m = mgr(num_device_blocks=8, num_host_blocks=16, write_policy=policy)
    p = prompt(32)  # 8 blocks: fills the device tier
    run(m, 1, p)
    ops = m.take_ops()
    if policy == "write_through":
        assert ops.swap_out == []  # KV not written yet: copies go out next step
    ops = m.take_ops()
    if policy == "write_through":
        assert len(ops.swap_out) == 8
    m.free(1, 2)
    # Fill beyond the device capacity: p's blocks are evicted (write_back copies them).
    run(m, 2, prompt(32, 1000), step=2)
    ops = m.take_ops()
    if policy == "write_back":
        assert len(ops.swap_out) == 8
    m.take_ops()
    m.free(2, 4)
    hashes = block_hashes(p, BS, KEY)
    assert set(digest_state(m).host_map().values()) >= set(hashes)
    assert m.lookup(p, KEY) == PrefixHit(0, 28)
    blocks = m.allocate(3, p, 32, KEY)
    assert m.num_cached_tokens(3) == PrefixHit(0, 28)
    ops = m.peek_ops()
    assert [b for _, b in ops.swap_in] == blocks[:7]
    host = digest_state(m).host_map()
    assert [host[s] for s, _ in ops.swap_in] == hashes[:7]
    # Blocks evicted now (seq 2's) go out to the host before being loaded over.
    if policy == "write_back":
        outs = {b for b, _ in ops.swap_out}
        assert {b for _, b in ops.swap_in} <= outs | set(range(8))
    m.commit(3, p, 32, 4)
    m.check_invariants()
    assert m.stats.num_host_hit_tokens == 28 and m.stats.num_swap_in_blocks == 7


def test_host_sources_are_pinned_while_host_is_full() -> None:
    # Host tier so small that the write-back of evicted blocks must find room by
    # evicting host slots: the slots being swapped in must not be among them.
    m = mgr(num_device_blocks=4, num_host_blocks=3)
    p = prompt(16)
    run(m, 1, p)
    m.take_ops()
    m.free(1, 1)
    run(m, 2, prompt(16, 500), step=1)  # evicts all 4 of p's blocks; host keeps 3
    m.take_ops()
    m.take_ops()
    m.free(2, 3)
    assert m.lookup(p, KEY) == PrefixHit(0, 12)
    m.allocate(3, p, 16, KEY)
    ops = m.peek_ops()
    assert len(ops.swap_in) == 3
    assert {s for s, _ in ops.swap_in}.isdisjoint({s for _, s in ops.swap_out})
    m.check_invariants()


def test_reset_prefix_cache() -> None:
    m = mgr(num_host_blocks=8)
    run(m, 1, prompt(16))
    run(m, 2, prompt(16, 100))
    m.take_ops()
    m.free(1, 1)
    assert m.reset_prefix_cache() == 4
    assert m.lookup(prompt(16), KEY) == PrefixHit(0, 0)
    assert m.lookup(prompt(16, 100), KEY) == PrefixHit(12, 0)  # referenced: kept
    m.check_invariants()


def test_rolled_back_swap_in_targets_are_not_reused_in_the_same_step() -> None:
    # A block being loaded this step must not become a second swap_in target in the
    # same batch (workers copy a batch with one indexed store: order undefined).
    m = mgr(num_device_blocks=4, num_host_blocks=16)
    p, q, r = prompt(16), prompt(16, 100), prompt(16, 200)
    for sid, toks in ((1, p), (2, q), (3, r)):  # each evicts the previous one to the host
        run(m, sid, toks, step=2 * sid - 2)
        m.take_ops()
        m.free(sid, 2 * sid - 1)
        m.take_ops()
    assert m.lookup(p, KEY) == PrefixHit(0, 12) and m.lookup(q, KEY) == PrefixHit(0, 12)
    loaded = m.allocate(4, p, 16, KEY)[:3]
    m.free(4, 6)  # admission rolled back: the 3 blocks being loaded stay cached, busy
    m.check_invariants()
    assert m.allocate(5, q, 16, KEY) is None  # would need the busy blocks
    assert m.lookup(p, KEY) == PrefixHit(12, 0)  # but they can be hit
    assert m.allocate(6, p, 16, KEY)[:3] == loaded
    m.check_invariants()
    m.take_ops()
    m.free(6, 7)
    assert m.allocate(5, q, 16, KEY) is not None  # next step they are ordinary cached blocks
    m.check_invariants()


def test_trim_frees_blocks_appended_for_rejected_drafts() -> None:
    """Speculative decoding: blocks allocated for draft tokens the model rejected go back
    to the free list (never the LRU: they hold no verified token); registered blocks and
    those another sequence shares cannot be trimmed."""
    m = mgr()
    p = prompt(9)  # 2 full blocks + 1 token
    table = run(m, 1, p)
    m.take_ops()
    more = m.allocate(1, p, 9 + 8, KEY)  # room for 8 drafts: 2 more blocks
    assert len(more) == 2
    m.commit(1, p, 9, 1)  # drafts are never committed
    m.take_ops()
    assert m.trim(1, 3) == more
    m.check_invariants()
    assert m.block_table(1) == table and m.usage()["device"]["free"] == 16 - 3
    assert m.trim(1, 3) == []
    with pytest.raises(AssertionError, match="registered"):
        m.trim(1, 1)  # its first two blocks are in the index
    m.free(1, 2)
    m.check_invariants()
    assert m.usage()["device"]["used"] == 0


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_blocks_committed_as_their_sequence_closes_are_not_evicted_that_step(policy) -> None:
    """Scheduler `_close` registers a sequence's last full blocks (KV written, but no plan
    knew all their tokens: a drafted step's kept drafts, a pending token) as it frees
    them. Hittable at once, but not evicted in that step: ranks apply a step's swap_out
    before its register, so a host copy then would name the block's old hash. Under
    write_through they are copied to the host the step after, like any commit."""
    m = mgr(num_device_blocks=4, num_host_blocks=8, write_policy=policy)
    p = prompt(8)
    first, last = m.allocate(1, p, 8, KEY)
    m.commit(1, p, 4, 0)  # the plan knew 4 of the 8 tokens it ran
    m.take_ops()
    m.commit(1, p, 8, 0, closing=True)
    m.free(1, 1)
    m.check_invariants()
    assert m.lookup(p + [99], KEY).num_tokens == 8
    q = prompt(16, start=100)
    assert m.allocate(2, q, 16, KEY) is None  # would evict the block just registered
    assert m.allocate(3, q, 12, KEY) is not None  # evicts the older one only
    ops = m.take_ops()
    assert ops.registered[-1][0] == last
    # `first` goes to the host as it is evicted (write_back) or as the step after its
    # commit (write_through); `last`, under write_through, the step after its own
    assert [b for b, _ in ops.swap_out] == [first]
    assert [b for b, _ in m.take_ops().swap_out] == ([] if policy == "write_back" else [last])
    m.check_invariants()
