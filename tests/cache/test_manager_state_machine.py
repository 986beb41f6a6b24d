"""Random scheduler-like traffic against KVCacheManager and a simulated worker.

The simulated worker holds, for every device block and host slot, the "KV" it contains:
(extra_key, the token prefix that produced it). Each step it applies the drained ops in
the workers' order (swap_out, then swap_in, then the KV writes of the tokens scheduled
that step); afterwards every block of every live sequence must hold exactly the KV of
that sequence's prefix -- a prefix hit never serves stale KV -- and every indexed block
or slot must hold the KV its hash stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis
import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cache import CacheConfig, KVCacheManager, make_extra_key
from tests.cache.digest import block_hashes, digest_state, keys_to_bytes

KEYS = [make_extra_key("m", None), make_extra_key("m", "tenant-b")]
# Filler token ids: past the bases' 0..2, and under 100 on purpose. Hypothesis mixes the
# integer literals of the project modules a process has imported (those of 100 and up)
# into wide integer draws, so with a range like 3..10**6 the examples `make test` replays
# depended on which other test files ran first, and on literals anywhere in the code.
FILLER = st.integers(3, 99)
Content = tuple[bytes, tuple[int, ...]]


def event(value: str) -> None:
    """`hypothesis.event`, or nothing in a plain test (the scripted step sequences below)."""
    if currently_in_test_context():
        hypothesis.event(value)


@dataclass
class SimSeq:
    key: bytes
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    computed: int = 0
    scheduled_step: int = -1
    held: bool = False  # waiting, its cached prefix held (`hold`), not admitted yet


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_device_blocks=st.integers(3, 16),
        num_host_blocks=st.sampled_from([0, 3, 8, 12, 40]),
        write_policy=st.sampled_from(["write_back", "write_through"]),
        caching=st.sampled_from([True, True, True, False]),
        num_disk_blocks=st.sampled_from([0, 0, 4, 30]),
        bases=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=24),
                       min_size=2, max_size=3),
    )
    def init(self, block_size, num_device_blocks, num_host_blocks, write_policy, caching,
             num_disk_blocks, bases) -> None:
        self.cfg = CacheConfig(block_size=block_size, num_device_blocks=num_device_blocks,
                               num_host_blocks=num_host_blocks, write_policy=write_policy,
                               enable_prefix_caching=caching, num_disk_blocks=num_disk_blocks,
                               num_ranks=2)
        self.m = KVCacheManager(self.cfg)
        self.bs = block_size
        self.bases = bases
        self.seqs: dict[int, SimSeq] = {}
        self.next_id = 0
        self.step = 0
        self.writes: list[tuple[int, int, int]] = []  # (seq, start, stop) this step
        self.device: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        # the disk tier on two simulated ranks: what each holds per disk slot, and the
        # writes each has queued (write id, disk slot, content), finished in any order
        self.disks: list[dict[int, Content]] = [{}, {}]
        self.disk_queues: list[list[tuple[int, int, Content]]] = [[], []]
        # the reads each has in flight (read id, disk slot, host slot, content wanted),
        # and the sequences waiting on theirs (cache/disk_flow.py): seq id -> (seq, chunk,
        # the hashes of the blocks it started reading)
        self.read_queues: list[list[tuple[int, int, int, Content]]] = [[], []]
        self.waiting: dict[int, tuple[SimSeq, int, set[bytes]]] = {}
        self.damaged: list[set[int]] = [set(), set()]  # disk slots a flipped byte broke
        self.content_of: dict[bytes, Content] = {}  # hash -> the KV it stands for
        self.history: list[tuple[bytes, list[int]]] = []  # closed conversations

    # --- helpers ------------------------------------------------------------------------

    def content(self, seq: SimSeq, stop: int) -> Content:
        return (seq.key, tuple(seq.tokens[:stop]))

    def learn_hashes(self, seq: SimSeq, upto: int) -> None:
        for i, h in enumerate(block_hashes(seq.tokens[:upto], self.bs, seq.key)):
            self.content_of.setdefault(h, self.content(seq, (i + 1) * self.bs))
            assert self.content_of[h] == self.content(seq, (i + 1) * self.bs)

    def servable_tokens(self, tokens: list[int], key: bytes, reads: set[bytes]) -> int:
        """The most a retry can take: the prefix of blocks the device or host tier holds,
        or the sequence's own disk reads fetched. Not `lookup`: it counts a disk block
        only where a host slot could take it now, and a waiting sequence's reads hold
        theirs already (with no other slot free, `lookup` finds none of them)."""
        digest = digest_state(self.m)
        held = set(digest.device_map().values()) | set(digest.host_map().values()) | reads
        cap = (len(tokens) - 1) // self.bs
        n = 0
        for h in block_hashes(tokens[:cap * self.bs], self.bs, key):
            if h not in held:
                break
            n += 1
        return n * self.bs

    def snapshot(self):
        m = self.m
        return (m.usage(), digest_state(m).fingerprint(), m.peek_ops(), m.stats.as_dict(),
                m.device.refcount.copy().tolist())

    def grow(self, sid: int, seq: SimSeq, num_tokens: int) -> bool:
        """allocate + commit, as the scheduler does for a scheduled chunk."""
        before = self.snapshot()
        refs_before = self.m.device.refcount.copy()
        blocks = self.m.allocate(sid, seq.tokens, num_tokens, seq.key)
        if blocks is None:
            assert self.snapshot() == before, "a failed allocate changed state"
            return False
        for b in blocks:  # never a block some live sequence still uses (no hit here)
            assert refs_before[b] == 0
        seq.table += blocks
        start = seq.computed
        seq.computed = max(seq.computed, num_tokens)
        self.m.commit(sid, seq.tokens, seq.computed, self.step)
        seq.scheduled_step = self.step
        self.writes.append((sid, start, seq.computed))
        self.learn_hashes(seq, seq.computed)
        return True

    def live_unscheduled(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items()
                      if q.scheduled_step != self.step and not q.held)

    def held_ids(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items() if q.held)

    # --- rules --------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < 8)
    @rule(data=st.data())
    def new_seq_rule(self, data) -> None:
        self.new_seq(data)

    def new_seq(self, data) -> None:
        """A prompt sharing a prefix with others, or filler that pushes the cache out."""
        if data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.bases))
            tokens = base[:data.draw(st.integers(0, len(base)))]
        else:
            tokens = data.draw(st.lists(FILLER, min_size=1, max_size=24))
        suffix = data.draw(st.lists(st.integers(0, 2), max_size=6))
        self.admit(data, (tokens + suffix) or [0], data.draw(st.sampled_from(KEYS)))

    @precondition(lambda self: self.history and len(self.seqs) < 8)
    @rule(data=st.data())
    def revisit_rule(self, data) -> None:
        self.revisit(data)

    def revisit(self, data) -> None:
        """An agent resends a finished conversation plus a new turn."""
        key, tokens = data.draw(st.sampled_from(self.history))
        suffix = data.draw(st.lists(st.integers(0, 2), max_size=6))
        self.admit(data, tokens + suffix, key)

    def admit(self, data, tokens: list[int], key: bytes, chunk: int | None = None,
              sid: int | None = None) -> None:
        """A new sequence, or (``sid``) the retry of one that waited on its disk reads."""
        seq = SimSeq(key, tokens)
        retry = sid is not None
        if sid is None:
            sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.m.lookup(tokens, seq.key)
        assert hit.num_tokens % self.bs == 0 and hit.num_tokens <= len(tokens) - 1
        if chunk is None:
            chunk = data.draw(st.one_of(st.just(len(tokens)), st.integers(1, 12)))
        num_tokens = min(len(tokens), hit.num_tokens + chunk)
        reads = self.waiting[sid][2] if retry else set()
        servable = self.servable_tokens(tokens, key, reads) if retry else 0
        before = self.snapshot()
        refs_before = self.m.device.refcount.copy()
        ops_before = self.m.peek_ops()
        blocks = self.m.allocate(sid, tokens, num_tokens, seq.key)
        if blocks is None and self.m.reading(sid):
            event("retry: reads still in flight" if retry else "disk reads started")
            assert not self.m.has_seq(sid)
            read = self.m.peek_ops().disk_read[len(ops_before.disk_read):]
            if not retry:
                assert len(read) * self.bs == hit.num_disk_tokens > 0
            lo, hi = (np.array([op[i] for op in read], np.uint64) for i in (3, 4))
            self.waiting[sid] = (seq, chunk, reads | set(keys_to_bytes(lo, hi)))
            return
        self.waiting.pop(sid, None)
        if blocks is None:
            event("retry refused: full" if retry else "new seq refused: full")
            assert retry or self.snapshot() == before
            assert not self.m.has_seq(sid)
            return
        got = self.m.num_cached_tokens(sid)
        if retry:  # the reads that failed a check on some rank are recomputed
            event("admitted after its disk reads")
            if got.num_tokens > hit.num_tokens:
                event("admitted after its disk reads: more than lookup saw")
            assert got.num_tokens <= servable
            hit = got
        assert got == hit  # nothing changed since lookup
        event("hit: " + ("disk" if hit.num_disk_tokens else "host" if hit.num_host_tokens else
                         "device" if hit.num_device_tokens else "none"))
        n_hit = hit.num_tokens // self.bs
        assert len(blocks) == max(n_hit, -(-num_tokens // self.bs))
        hashes = block_hashes(tokens[:n_hit * self.bs], self.bs, seq.key)
        dev_map = digest_state(self.m).device_map()
        for i, b in enumerate(blocks):
            if refs_before[b] > 0:  # only a device hit may share a live block
                assert i < n_hit and dev_map[b] == hashes[i]
        loaded = self.m.peek_ops().swap_in[len(ops_before.swap_in):]
        assert len(loaded) * self.bs == hit.num_host_tokens + hit.num_disk_tokens
        assert self.m.peek_ops().disk_read == ops_before.disk_read  # read before, not now
        for _slot, b in loaded:
            assert refs_before[b] == 0 and b in blocks[:n_hit]
        seq.table = list(blocks)
        seq.computed = hit.num_tokens
        self.seqs[sid] = seq
        if chunk != len(tokens) and data.draw(st.integers(0, 9)) == 0:  # rolled back
            self.m.free(sid, self.step)
            del self.seqs[sid]
            return
        self.m.commit(sid, tokens, num_tokens, self.step)
        seq.scheduled_step = self.step
        self.writes.append((sid, seq.computed, num_tokens))
        seq.computed = max(seq.computed, num_tokens)
        self.learn_hashes(seq, seq.computed)

    @precondition(lambda self: len(self.seqs) < 8 and self.history)
    @rule(data=st.data())
    def hold_waiting(self, data) -> None:
        """A returning turn waits in the queue: its cached prefix is held (device hits
        referenced, host hits copied in now), or nothing changes."""
        key, tokens = data.draw(st.sampled_from(self.history))
        tokens = tokens + data.draw(st.lists(st.integers(0, 2), max_size=6))
        sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.m.lookup(tokens, key)
        reserve = data.draw(st.integers(0, 4))
        before = self.snapshot()
        ops_before = self.m.peek_ops()
        got = self.m.hold(sid, tokens, key, None, reserve=reserve)
        if got is None:
            if self.m.reading(sid):
                event("hold started disk reads")
                self.m.cancel_reads(sid)  # the waiting request leaves
            else:
                event("hold refused")
                assert self.snapshot() == before
            return
        event("held: " + ("host" if got.num_host_tokens else "device" if got.num_tokens
                          else "nothing"))
        assert got == hit and not hit.num_disk_tokens
        assert self.m.num_allocatable_blocks() >= reserve
        counted = ("num_queried_tokens", "num_device_hit_tokens", "num_host_hit_tokens",
                   "num_disk_hit_tokens")
        stats = self.m.stats.as_dict()
        assert all(stats[k] == before[3][k] for k in counted), "counted at admission only"
        loaded = self.m.peek_ops().swap_in[len(ops_before.swap_in):]
        assert len(loaded) * self.bs == hit.num_host_tokens
        seq = SimSeq(key, tokens, self.m.block_table(sid), hit.num_tokens, held=True)
        assert len(seq.table) == hit.num_tokens // self.bs
        self.seqs[sid] = seq
        self.learn_hashes(seq, seq.computed)

    @precondition(lambda self: self.held_ids())
    @rule(data=st.data())
    def admit_held(self, data) -> None:
        """The held sequence's turn: its first chunk, the held prefix as its hit."""
        sid = data.draw(st.sampled_from(self.held_ids()))
        seq = self.seqs[sid]
        budget = data.draw(st.integers(1, 12))
        queried = self.m.stats.num_queried_tokens
        blocks = self.m.allocate(sid, seq.tokens, len(seq.tokens), seq.key, budget=budget)
        if blocks is None:
            if not self.m.has_seq(sid):  # let go for a longer hit, which is on disk
                event("held, then reads for a longer hit")
                del self.seqs[sid]
                self.m.cancel_reads(sid)
            else:
                event("held, no room to admit")
            return
        hit = self.m.num_cached_tokens(sid)
        assert hit.num_tokens >= seq.computed
        if hit.num_tokens == seq.computed:
            assert blocks[:len(seq.table)] == seq.table
        assert self.m.stats.num_queried_tokens == queried + len(seq.tokens)
        n = min(len(seq.tokens), hit.num_tokens + budget)
        seq.table, seq.held, seq.computed = list(blocks), False, hit.num_tokens
        assert len(blocks) == max(hit.num_tokens // self.bs, -(-n // self.bs))
        self.m.commit(sid, seq.tokens, n, self.step)
        seq.scheduled_step = self.step
        self.writes.append((sid, seq.computed, n))
        seq.computed = n
        self.learn_hashes(seq, n)

    @precondition(lambda self: self.held_ids())
    @rule(data=st.data())
    def release_held(self, data) -> None:
        """A held prefix gives way (a running sequence needs blocks), or the waiting
        request is aborted."""
        sid = data.draw(st.sampled_from(self.held_ids()))
        if data.draw(st.booleans()):
            self.m.release_hold(sid)
        else:
            self.m.free(sid, self.step)
        del self.seqs[sid]
        assert not self.m.has_seq(sid)

    @precondition(lambda self: self.live_unscheduled())
    @rule(data=st.data())
    def grow_seq(self, data) -> None:
        sid = data.draw(st.sampled_from(self.live_unscheduled()))
        seq = self.seqs[sid]
        if seq.computed < len(seq.tokens):  # prefill: next chunk
            n = min(len(seq.tokens), seq.computed + data.draw(st.integers(1, 12)))
        else:  # decode: the token sampled last step gets its KV now
            seq.tokens.append(data.draw(st.integers(0, 2)))
            n = len(seq.tokens)
        self.grow(sid, seq, n)

    @precondition(lambda self: self.live_unscheduled())
    @rule(data=st.data())
    def close(self, data) -> None:
        """Finish or abort (mid-prefill included): closed in a later step than its last run."""
        sid = data.draw(st.sampled_from(self.live_unscheduled()))
        self.m.free(sid, self.step)
        seq = self.seqs.pop(sid)
        self.history.append((seq.key, list(seq.tokens)))

    @precondition(lambda self: self.m.usage()["device"]["cached"] > 0
                  and self.m.num_allocatable_blocks() > 0)
    @rule(data=st.data())
    def eviction_pressure(self, data) -> None:
        """A filler prompt as big as everything allocatable runs for one step and closes:
        every cached block is evicted (to the host tier, when there is one)."""
        n = self.m.num_allocatable_blocks() * self.bs
        start = data.draw(FILLER)
        sid = self.next_id
        self.admit(data, list(range(start, start + n)), KEYS[0], chunk=n)
        self.step_done()
        if sid in self.seqs:
            self.m.free(sid, self.step)
            del self.seqs[sid]

    @precondition(lambda self: self.history and self.cfg.host_enabled and len(self.seqs) < 8
                  and self.m.num_allocatable_blocks() > 0)
    @rule(data=st.data())
    def come_back_after_eviction(self, data) -> None:
        """An idle session returns after its KV was pushed out to the host tier."""
        if self.m.usage()["device"]["cached"]:
            self.eviction_pressure(data)
        self.revisit(data)

    @rule(data=st.data())
    def scheduler_step(self, data) -> None:
        """A whole step the way the scheduler runs one: close some, grow the rest, admit."""
        for sid in self.live_unscheduled():
            action = data.draw(st.sampled_from(["close", "grow", "grow", "idle"]))
            if action == "close":
                self.m.free(sid, self.step)
                seq = self.seqs.pop(sid)
                self.history.append((seq.key, list(seq.tokens)))
            elif action == "grow":
                seq = self.seqs[sid]
                if seq.computed < len(seq.tokens):
                    n = min(len(seq.tokens), seq.computed + data.draw(st.integers(1, 16)))
                else:
                    seq.tokens.append(data.draw(st.integers(0, 2)))
                    n = len(seq.tokens)
                self.grow(sid, seq, n)
        for _ in range(data.draw(st.integers(0, 2))):
            if self.history and data.draw(st.booleans()):
                self.revisit(data)
            else:
                self.new_seq(data)
        self.step_done()

    @precondition(lambda self: any(q.scheduled_step == self.step for q in self.seqs.values()))
    @rule(data=st.data())
    def premature_close_is_refused(self, data) -> None:
        sid = data.draw(st.sampled_from(
            sorted(s for s, q in self.seqs.items() if q.scheduled_step == self.step)))
        before = self.snapshot()
        with pytest.raises(AssertionError):
            self.m.free(sid, self.step)
        assert self.m.has_seq(sid) and self.snapshot() == before

    @rule(data=st.data())
    def lookup_is_pure(self, data) -> None:
        base = data.draw(st.sampled_from(self.bases))
        before = self.snapshot()
        self.m.lookup(base[:data.draw(st.integers(0, len(base)))], KEYS[0])
        assert self.snapshot() == before

    @rule()
    def reset(self) -> None:
        self.m.reset_prefix_cache()

    @precondition(lambda self: self.cfg.disk_enabled)
    @rule(data=st.data())
    def memory_tiers_forget(self, data) -> None:
        """The device and host tiers lose their cached blocks (as after a restart; what
        this step's ops hold stays): a revisit can then only hit the disk."""
        if data.draw(st.booleans()):  # the disk caught up first
            self.step_done()
            for r in (0, 1):
                for _, slot, content in self.disk_queues[r]:
                    self.disks[r][slot] = content
                    self.damaged[r].discard(slot)  # rewritten whole
                self.m.report_disk_writes(r, [w for w, _, _ in self.disk_queues[r]], [])
                self.disk_queues[r] = []
        self.m.device.drop_cached()
        self.m.host.drop_cached()
        if self.history and len(self.seqs) < 8:
            self.revisit(data)

    @precondition(lambda self: any(self.read_queues))
    @rule(data=st.data())
    def disk_reads_land(self, data) -> None:
        """Some reads of one rank finish: checked against what that rank's disk holds."""
        r = data.draw(st.sampled_from([r for r in (0, 1) if self.read_queues[r]]))
        n = data.draw(st.integers(1, len(self.read_queues[r])))
        self.land_reads(r, n)
        if self.waiting and not any(self.read_queues) and data.draw(st.booleans()):
            self.retry(data)  # every read in: its sequence comes in (or is refused)

    def land_reads(self, r: int, n: int) -> None:
        done, bad = [], []
        for rid, d, s, want in self.read_queues[r][:n]:
            if self.disks[r].get(d) == want and d not in self.damaged[r]:
                done.append(rid)
                self.host[s] = want
            else:  # never served: the scheduler drops the block on every rank
                event("disk read failed its check")
                bad.append(rid)
        del self.read_queues[r][:n]
        self.m.report_disk_writes(r, [], [], done, bad)

    @precondition(lambda self: self.m.disk.num_committed)
    @rule(data=st.data())
    def disk_record_damaged(self, data) -> None:
        """A byte flips in one rank's copy of a committed record: a read of it fails."""
        r = data.draw(st.sampled_from([0, 1]))
        self.damaged[r].add(data.draw(st.sampled_from(
            self.m.disk.committed_items().tolist())))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def waiting_seq_retries(self, data) -> None:
        self.retry(data)

    def retry(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.waiting)))
        seq, chunk, _ = self.waiting[sid]
        self.admit(data, seq.tokens, seq.key, chunk, sid=sid)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def waiting_seq_aborts(self, data) -> None:
        """Aborted with its reads in flight: their slots come back once all ranks read."""
        sid = data.draw(st.sampled_from(sorted(self.waiting)))
        del self.waiting[sid]
        self.m.cancel_reads(sid)
        event("aborted while reading")

    @precondition(lambda self: any(self.disk_queues))
    @rule(data=st.data())
    def disk_writes_land(self, data) -> None:
        """Some queued disk writes of one rank finish, or are dropped (queue full)."""
        r = data.draw(st.sampled_from([r for r in (0, 1) if self.disk_queues[r]]))
        n = data.draw(st.integers(1, len(self.disk_queues[r])))
        done, dropped = [], []
        for wid, slot, content in self.disk_queues[r][:n]:
            if data.draw(st.integers(0, 4)) == 0:
                dropped.append(wid)
                event("disk write dropped")
            else:
                self.disks[r][slot] = content
                self.damaged[r].discard(slot)  # rewritten whole
                done.append(wid)
        del self.disk_queues[r][:n]
        self.m.report_disk_writes(r, done, dropped)

    @rule()
    def step_done(self) -> None:
        """Drain the ops and apply them the way every worker does."""
        ops = self.m.take_ops()
        self.step += 1
        if ops.swap_out:
            event("step with swap_out")
        if ops.swap_in:
            event("step with swap_in")
        if ops.swap_in and ops.swap_out:
            event("step with swap_out and swap_in")
        if self.m.stats.num_host_evictions:
            event("host evictions so far")
        nd, nh = self.cfg.num_device_blocks, self.cfg.num_host_blocks
        assert len({s for _, s in ops.swap_out}) == len(ops.swap_out)
        assert len({b for _, b in ops.swap_in}) == len(ops.swap_in)
        for b, s in ops.swap_out:
            assert 0 <= b < nd and 0 <= s < nh
            self.host[s] = self.device[b]  # KeyError = copying a never-written block
        for wid, s, d, _, _ in ops.disk_write:  # a rank copies the slot now, writes later
            event("step with disk_write")
            for q in self.disk_queues:
                q.append((wid, d, self.host[s]))
        for rid, d, s, lo, hi in ops.disk_read:  # only of slots every rank wrote
            event("step with disk_read")
            want = self.content_of[keys_to_bytes(np.array([lo], np.uint64),
                                                 np.array([hi], np.uint64))[0]]
            assert self.disks[0].get(d) == self.disks[1].get(d) == want, "a bad disk read"
            for q in self.read_queues:  # each rank reads in the background
                q.append((rid, d, s, want))
        for s, b in ops.swap_in:
            assert 0 <= b < nd and 0 <= s < nh
            self.device[b] = self.host[s]
        for sid, start, stop in self.writes:
            seq = self.seqs[sid]
            for i in range(start // self.bs, -(-stop // self.bs)):
                self.device[seq.table[i]] = self.content(seq, min((i + 1) * self.bs, stop))
        self.writes = []
        for seq in self.seqs.values():  # every block a sequence reads holds its KV
            for i in range(-(-seq.computed // self.bs)):
                got = self.device.get(seq.table[i])
                assert got == self.content(seq, min((i + 1) * self.bs, seq.computed))
        digest = digest_state(self.m)
        for b, h in digest.device_map().items():
            assert self.device.get(b) == self.content_of[h], "indexed block holds other KV"
        host = dict(self.host)
        for b, s in self.m.peek_ops().swap_out:  # write-through copies queued for next step
            host[s] = self.device[b]
        for s, h in digest.host_map().items():
            assert host.get(s) == self.content_of[h], "indexed host slot holds other KV"

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        m = self.m
        m.check_invariants()
        refs = np.zeros(self.cfg.num_device_blocks, dtype=np.int64)
        for sid, seq in self.seqs.items():
            assert m.block_table(sid) == seq.table
            refs[seq.table] += 1
        assert (refs == m.device.refcount).all()
        for tier, cap in (("device", self.cfg.num_device_blocks),
                          ("host", self.cfg.num_host_blocks if self.cfg.host_enabled else 0)):
            u = m.usage()[tier]
            assert min(u.values()) >= 0 and u["capacity"] == cap
            assert u["used"] + u["cached"] + u["free"] == cap
        if not self.seqs:
            assert m.usage()["device"]["used"] == 0 and not m.device.refcount.any()
        if not self.cfg.enable_prefix_caching:
            assert not digest_state(m).device_map() and m.usage()["device"]["cached"] == 0

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        self.step_done()  # finish the running step, then close everything
        for sid in list(self.seqs):
            self.m.free(sid, self.step)
        self.seqs.clear()
        assert self.m.num_held_blocks == 0
        for sid in list(self.waiting):  # aborted mid-read, then the reads land
            self.m.cancel_reads(sid)
        self.waiting.clear()
        for r in (0, 1):
            self.land_reads(r, len(self.read_queues[r]))
        self.consistent()
        assert self.m.usage()["device"]["used"] == 0
        # nothing leaked: no host slot reserved, no disk slot held by a read
        assert self.m.host.num_reserved == 0 and not self.m.disk.reading.any()


CacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_cache_state_machine = CacheMachine.TestCase


# --- step sequences found by the machine, replayed as plain tests -------------------------


class Script:
    """Stands in for a rule's `st.data()`: each `draw` gives the next of these values."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, strategy, label=None):
        assert self.values, f"no value scripted for a draw from {strategy!r}"
        return self.values.pop(0)


def replay(state: CacheMachine, steps) -> None:
    """Run (rule, Script or None) steps as Hypothesis would, invariant after each."""
    state.consistent()
    for step, script in steps:
        step() if script is None else step(script)
        assert script is None or not script.values, "a scripted draw left over"
        state.consistent()
    state.teardown()


def test_a_retry_may_take_more_than_lookup_saw() -> None:
    """A waiting sequence's reads hold every host slot: `lookup` of its prompt finds no
    room for a disk hit (0 tokens), and its retry takes the three blocks it read. The
    model once bounded a retry by that `lookup` (`assert 3 <= 0`)."""
    state = CacheMachine()
    state.init(block_size=1, num_device_blocks=10, num_host_blocks=3,
               write_policy="write_through", caching=True, num_disk_blocks=30,
               bases=[[0] * 4, [1] * 4])
    prompt = [5, 6, 7, 8]
    replay(state, [
        (state.new_seq_rule, Script(False, prompt, [], KEYS[0], len(prompt))),
        (state.step_done, None),  # write_through: the host copies are the next step's ops
        (state.close, Script(0)),
        (state.step_done, None),  # three blocks to the three host slots, and to disk
        (state.disk_writes_land, Script(0, 3, 1, 1, 1)),
        (state.disk_writes_land, Script(1, 3, 1, 1, 1)),
        # the prompt comes back with the disk alone holding it: three reads start
        (state.memory_tiers_forget, Script(False, (KEYS[0], prompt), [], len(prompt))),
        (state.step_done, None),  # the plan with the reads
        (state.disk_reads_land, Script(0, 3)),
        (state.disk_reads_land, Script(1, 3, True, 1)),  # every read in: the retry
        (state.step_done, None),
    ])
