"""The wire format and the shared state digest (no processes, no torch)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire import codec
from wire.client import RequestOutput, SamplingParams, UncachedTokens
from wire.codec import SCHEMA_VERSION
from wire.config import EngineConfig, SpeculativeConfig
from wire.control import CacheView, RequestRecord
from wire.digest import StateDigest
from wire.step import (
    PENDING_TOKEN,
    AppendBlocks,
    DecodeBatch,
    NewSequence,
    RankTiming,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TrimBlocks,
)

ints = st.integers(min_value=0, max_value=2**31 - 1)


@given(
    step=ints,
    tables=st.lists(st.tuples(ints, st.lists(ints, max_size=8)), max_size=4),
    swaps=st.lists(st.tuples(ints, ints), max_size=4),
    register=st.lists(st.tuples(ints, st.integers(0, 2**64 - 1)), max_size=4),
    temperature=st.floats(0, 2),
)
def test_plans_round_trip(step, tables, swaps, register, temperature):
    plan = StepPlan(
        step=step, swap_out=swaps, swap_in=[(b, a) for a, b in swaps], close=[1, 2],
        new_seqs=[NewSequence(sid, blocks, SamplingParams(temperature, 0.9, 5, 7))
                  for sid, blocks in tables],
        chunks=[ScheduledChunk(sid, blocks or [1], 3, True) for sid, blocks in tables],
        register=register,
        decodes=DecodeBatch([sid for sid, _ in tables], [7] * len(tables),
                            [PENDING_TOKEN] * len(tables)),
    )
    assert codec.decode(codec.encode(plan)) == plan


def test_other_messages_round_trip():
    for msg in (EngineConfig(model="/m", world_size=4, host_cache_memory=1 << 30),
                EngineConfig(model="/m", null_model_forward_ms=0.0),
                EngineConfig(model="/m", speculative=SpeculativeConfig("ngram", 5, 3, 1)),
                StepPlan(4, trim=[TrimBlocks(1, 2, [7, 8])],
                         chunks=[ScheduledChunk(1, [5, 6, 7], 9, True, num_draft=2)]),
                StepResult(3, 1, 2**64 - 1, [(1, 2)], RankTiming(0.1, 0.2, 0.3, 0.4, 0.5, 0.6,
                                                                 0.7), None),
                RequestOutput("r", [1, 2], True, "stop", 10, 4, 2)):
        assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize("frame,match", [
    (msgpack.packb([SCHEMA_VERSION + 1, "StepPlan", [1]]), "schema version"),
    (msgpack.packb([SCHEMA_VERSION, "Pickle", []]), "unknown message type"),
    (msgpack.packb([SCHEMA_VERSION, "StepPlan", [1, 2]]), "expected"),
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([SCHEMA_VERSION, "SamplingParams", [-1.0, 1.0, 0, None]]), "temperature"),
])
def test_bad_frames_are_refused(frame, match):
    with pytest.raises(codec.ProtocolError, match=match):
        codec.decode(frame)


def test_a_message_left_in_a_file_comes_back_whole(tmp_path):
    """The run directory's engine config (the launcher writes it, the scheduler reads it):
    the nested speculative config comes back a SpeculativeConfig, not a dict."""
    config = EngineConfig(model="/m", speculative=SpeculativeConfig("ngram", 5, 3, 1),
                          null_model_forward_ms=1.5)
    codec.write_file(tmp_path / "config.msgpack", config)
    back = codec.read_file(tmp_path / "config.msgpack", EngineConfig)
    assert back == config and type(back.speculative) is SpeculativeConfig
    with pytest.raises(codec.ProtocolError, match="not a StepPlan"):
        codec.read_file(tmp_path / "config.msgpack", StepPlan)


def test_a_config_holds_its_speculative_config_typed():
    """A dict there (EngineConfig(**json.load(...))) is refused where it is made, not
    found out when the config is sent to the ranks."""
    with pytest.raises(TypeError, match="SpeculativeConfig or None, not dict"):
        EngineConfig(model="/m", speculative={"method": "ngram"})


def test_unregistered_types_are_not_encoded():
    with pytest.raises(codec.ProtocolError):
        codec.encode(object())


def plans() -> list[StepPlan]:
    return [
        StepPlan(0, new_seqs=[NewSequence(1, [0, 1, 2]), NewSequence(2, [3])],
                 register=[(0, 11), (1, 12)]),
        StepPlan(1, swap_out=[(0, 5), (1, 6)], append=[]),
        StepPlan(2, close=[1], swap_in=[(5, 7)], register=[(3, 99)]),
    ]


def test_digest_tracks_tables_and_both_tiers():
    a, b = StateDigest(8, 8), StateDigest(8, 8)
    for plan in plans():
        a.apply(plan)
        b.apply(plan)
        assert a.value == b.value
    assert a._slot_hash[5] == 11 and a._block_hash[7] == 11  # swapped out, then back in
    # a rank that missed a swap_out holds other host contents: the digest differs
    c = StateDigest(8, 8)
    for plan in plans():
        if plan.step == 1:
            plan = StepPlan(1, swap_out=[(0, 5)])
        c.apply(plan)
    assert c.value != a.value


def test_digest_trim_undoes_exactly_the_dropped_appends():
    """A trim (blocks appended for rejected drafts) leaves the digest as if they had never
    been appended; one naming other blocks or not the table's tail is refused."""
    a, b = StateDigest(16, 0), StateDigest(16, 0)
    a.apply(StepPlan(0, new_seqs=[NewSequence(3, [1, 2])]))
    b.apply(StepPlan(0, new_seqs=[NewSequence(3, [1, 2])]))
    a.apply(StepPlan(1, append=[AppendBlocks(3, [5, 6])]))
    a.apply(StepPlan(2, trim=[TrimBlocks(3, 2, [5, 6])]))
    assert a.value == b.value and a.tables()[3][0] == 2
    a.apply(StepPlan(3, append=[AppendBlocks(3, [9])]))
    b.apply(StepPlan(3, append=[AppendBlocks(3, [9])]))
    assert a.value == b.value
    with pytest.raises(AssertionError):
        a.apply(StepPlan(4, trim=[TrimBlocks(3, 1, [2])]))


def test_digest_returns_to_empty():
    d = StateDigest(4, 0)
    d.apply(StepPlan(0, new_seqs=[NewSequence(9, [1, 2])]))
    assert d.value != 0
    d.apply(StepPlan(1, close=[9]))
    assert d.value == 0


@given(seq_id=st.integers(0, 2**40), start=st.integers(0, 2**31 - 100),
       blocks=st.lists(ints, min_size=1, max_size=40))
def test_vectorised_table_digest_equals_the_scalar_one(seq_id, start, blocks):
    from wire.digest import _MASK64, _entry, table_digest

    scalar = 0
    for i, b in enumerate(blocks, start=start):
        scalar = (scalar + _entry(StateDigest.SEQ_BLOCK, (seq_id << 32) | i, b)) & _MASK64
    assert table_digest(seq_id, blocks, start) == scalar



def _valid_or_none(cls):
    def build(**kwargs):
        try:
            return cls(**kwargs)
        except ValueError:  # refused by its own checks
            return None
    return build


def _values(tp):
    """Values of a field's declared type, within what msgpack carries (64-bit ints,
    finite floats), built from the same hints the codec reads."""
    import types
    import typing
    from dataclasses import MISSING, fields, is_dataclass

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_values(a) for a in args])
    if is_dataclass(tp):
        # A type that checks its values (__post_init__) keeps its defaults: random text
        # is no valid dtype. Its other fields still vary.
        checked = hasattr(tp, "__post_init__")
        defaults = {f.name for f in fields(tp)
                    if f.default is not MISSING or f.default_factory is not MISSING}
        kwargs = {name: _values(ftp) for name, ftp in codec._field_types(tp)
                  if not (checked and name in defaults)}
        return st.builds(_valid_or_none(tp), **kwargs).filter(lambda v: v is not None)
    if origin is list:
        return st.lists(_values(args[0]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_values(args[0]), max_size=3).map(tuple)
        return st.tuples(*[_values(a) for a in args])
    if origin is dict:
        return st.dictionaries(_values(args[0]), _values(args[1]), max_size=3)
    return {int: st.integers(-2**63, 2**63 - 1), float: st.floats(allow_nan=False),
            str: st.text(max_size=5), bytes: st.binary(max_size=5), bool: st.booleans(),
            type(None): st.none()}[tp]


@pytest.mark.parametrize("name", sorted(codec._REGISTRY))
def test_every_message_type_round_trips(name):
    """Each type's converters are built once from its hints (codec._encoder, _decoder):
    a hint read wrong shows here as a value of that type that comes back changed."""
    cls = codec._REGISTRY[name]

    @given(_values(cls))
    def round_trip(msg):
        back = codec.decode(codec.encode(msg))
        assert type(back) is cls and back == msg

    round_trip()


@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 2**64 - 1)), max_size=40,
                unique_by=lambda p: p[0]),
       st.integers(1, 12))
def test_digest_is_the_same_in_small_and_large_batches(pairs, size):
    """Op lists of up to 8 entries take the plain-int path (StateDigest._set_few), longer
    ones numpy's: the two must be one function."""
    again = [(b, h ^ 1) for b, h in pairs]  # the blocks re-registered: old hashes leave
    whole, parts = StateDigest(64, 64), StateDigest(64, 64)
    whole.apply(StepPlan(0, register=pairs))
    whole.apply(StepPlan(1, swap_out=[(b, b) for b, _ in pairs]))
    whole.apply(StepPlan(2, register=again))
    for step, ops in ((0, pairs), (1, None), (2, again)):
        for i in range(0, len(pairs), size):
            if ops is None:
                parts.apply(StepPlan(1, swap_out=[(b, b) for b, _ in pairs[i:i + size]]))
            else:
                parts.apply(StepPlan(step, register=ops[i:i + size]))
    assert whole.value == parts.value
    tiers = whole.tier_digests()
    assert (tiers["host"] + tiers["device"]) & (2**64 - 1) == whole.value


@given(st.lists(st.tuples(st.integers(0, 5), st.lists(ints, max_size=12)), max_size=8),
       st.lists(st.tuples(st.integers(0, 5), st.lists(ints, max_size=12)), max_size=8))
def test_digest_adds_a_plans_table_entries_as_one_by_one(opened, appended):
    """A plan's new tables and appends over 8 entries in all take one numpy pass
    (StateDigest._add_tables); it must add what `add_blocks` adds, list by list, in the
    plan's order, also for a sequence opened and appended to in the same plan."""
    new_seqs = [NewSequence(s, ids) for s, ids in dict(opened).items()]
    append = [AppendBlocks(s, ids) for s, ids in appended if s in dict(opened)]
    whole, one_by_one = StateDigest(), StateDigest()
    whole.apply(StepPlan(0, new_seqs=new_seqs, append=append))
    for t in new_seqs + append:
        one_by_one.add_blocks(t.seq_id, t.block_ids)
    assert whole.value == one_by_one.value and whole.tables() == one_by_one.tables()
    whole.apply(StepPlan(1, close=[s.seq_id for s in new_seqs]))
    assert whole.value == 0


def test_why_a_prompt_missed_round_trips():
    """RequestOutput.uncached (schema 14), on the output that carries it and as None."""
    why = UncachedTokens(evicted=32, new=16, block_remainder=3, evicted_tier="host",
                         evicted_age_s=12.5, evicted_by="write_back")
    for msg in (RequestOutput("r", [1], False, None, 51, 0, 0, uncached=why),
                RequestOutput("r", [2], False, None, 51),
                RequestRecord("r", "s", "stop", 51, 2, 0, 0, 0.1, 0.2, 0.3, uncached=why),
                CacheView(1, 51, 0, 0, uncached=why.by_reason(),
                          uncached_requests={"evicted": 1})):
        assert codec.decode(codec.encode(msg)) == msg
    assert (why.num_tokens, why.main_reason) == (51, "evicted")
    assert UncachedTokens(new=16, salt=16).main_reason == "salt"  # ties: the actionable one
    assert UncachedTokens().main_reason == ""


def test_a_hybrid_models_state_fields_round_trip():
    """Schema 15: a sequence's state slot, a chunk's snapshots, a plan's state copies and
    registrations, the ranks' state slots, the snapshot interval, the no_state reason."""
    from wire.lifecycle import EngineLimits, WorkerReady
    plan = StepPlan(7, new_seqs=[NewSequence(1, [0, 1], state_slot=3)],
                    chunks=[ScheduledChunk(1, [5] * 40, 0, True, state_snapshots=[(16, 4),
                                                                                    (32, 5)])],
                    state_copy=[(9, 3)], state_register=[(4, 2**64 - 1), (6, 0)])
    limits = EngineLimits(1000, 512, (3,), 64, 0, 4096, num_state_slots=80,
                          state_bytes_per_slot=1 << 20)
    for msg in (plan, WorkerReady(0, "cpu", limits),
                EngineConfig(model="/m", state_snapshot_interval=8),
                RequestOutput("r", [1], False, None, 51, uncached=UncachedTokens(no_state=16))):
        assert codec.decode(codec.encode(msg)) == msg
    assert limits.is_hybrid and not EngineLimits(1000, 512, (3,), 64, 0).is_hybrid


def test_digest_covers_which_hash_each_state_slot_holds():
    """Registered, replaced, removed (hash 0): a rank that missed any of them differs."""
    a, b = StateDigest(4, 0), StateDigest(4, 0)
    a.apply(StepPlan(0, state_register=[(2, 11), (5, 12)]))
    assert a.value != 0 and a.state_hashes() == {2: 11, 5: 12}
    a.apply(StepPlan(1, state_register=[(2, 0), (5, 13)]))
    b.apply(StepPlan(0, state_register=[(5, 13)]))
    assert a.value == b.value and a.state_hashes() == {5: 13}
    assert sum(a.tier_digests().values()) == a.value  # the state's part is one of them
    b.apply(StepPlan(1, state_register=[(5, 0)]))
    assert b.value == 0


def test_host_state_swaps_round_trip_and_move_the_digest():
    """Schema 16: a plan's snapshots demoted to the host and restored from it, the ranks'
    host snapshot slots; a swap_out gives the host slot the device slot's hash."""
    from wire.lifecycle import EngineLimits
    plan = StepPlan(3, state_swap_out=[(4, 0), (6, 9)], state_swap_in=[(9, 1)])
    limits = EngineLimits(1000, 512, (3,), 64, 32, 4096, num_state_slots=20,
                          state_bytes_per_slot=1 << 20, num_host_state_slots=8)
    for msg in (plan, limits):
        assert codec.decode(codec.encode(msg)) == msg
    a, b = StateDigest(4, 0), StateDigest(4, 0)
    for d in (a, b):
        d.apply(StepPlan(0, state_register=[(4, 11), (6, 12)]))
    # the swap_out reads the hashes the slots held before this plan's registrations
    a.apply(StepPlan(1, state_swap_out=[(4, 0), (6, 9)], state_register=[(4, 0), (6, 13)]))
    assert a.host_state_hashes() == {0: 11, 9: 12} and a.state_hashes() == {6: 13}
    b.apply(StepPlan(1, state_swap_out=[(4, 0)], state_register=[(4, 0), (6, 13)]))
    assert a.value != b.value, "a rank that missed a demotion differs"
    assert sum(a.tier_digests().values()) % 2**64 == a.value


def test_state_disk_ops_round_trip_and_move_the_digest():
    """Schema 17: snapshots written from host state slots to disk and read back; a write
    gives the disk slot the host slot's hash, a read the host slot the disk slot's."""
    from wire.lifecycle import EngineLimits, WorkerReady
    plan = StepPlan(3, state_disk_write=[(0, 1, 2, 11, 21)],
                    state_disk_read=[(5, 3, 0, 12, 22)])
    limits = EngineLimits(1000, 512, (3,), 64, 32, 4096, num_state_slots=20,
                          state_bytes_per_slot=1 << 20, num_host_state_slots=8,
                          num_disk_state_slots=6)
    ready = WorkerReady(0, "cpu", limits, state_disk_found=[(3, 12, 22)])
    result = StepResult(3, 1, 0, state_disk_done=[0], state_disk_read_bad=[5])
    for msg in (plan, limits, ready, result):
        assert codec.decode(codec.encode(msg)) == msg
    a, b = StateDigest(4, 0), StateDigest(4, 0)
    for d in (a, b):
        d.apply(StepPlan(0, state_register=[(4, 11)]))
        d.apply(StepPlan(1, state_swap_out=[(4, 1)], state_register=[(4, 0)]))
    a.apply(StepPlan(2, state_disk_write=[(0, 1, 2, 11, 21)]))
    assert a.disk_state_hashes() == {2: 11}
    assert a.value != b.value, "a rank that missed a write differs"
    a.restore_disk_states([3], [12])
    a.apply(StepPlan(3, state_disk_read=[(5, 3, 0, 12, 22)]))
    assert a.host_state_hashes() == {1: 11, 0: 12}
    assert sum(a.tier_digests().values()) % 2**64 == a.value


def test_the_snapshot_interval_the_ranks_chose_round_trips():
    """Schema 18: the ranks report the interval they snapshot at (under `auto`, chosen from
    the bytes: worker/budget.py); the config's `auto` is SNAPSHOT_INTERVAL_AUTO (0), and
    a negative one is refused."""
    from wire.config import SNAPSHOT_INTERVAL_AUTO, ConfigError
    from wire.lifecycle import EngineLimits, WorkerReady
    limits = EngineLimits(1000, 512, (3,), 64, 32, 4096, num_state_slots=20,
                          state_bytes_per_slot=1 << 20, state_snapshot_interval=197)
    config = EngineConfig(model="/m")
    assert config.state_snapshot_interval == SNAPSHOT_INTERVAL_AUTO
    for msg in (limits, WorkerReady(0, "cpu", limits), config):
        assert codec.decode(codec.encode(msg)) == msg
    assert codec.decode(codec.encode(limits)).state_snapshot_interval == 197
    with pytest.raises(ConfigError, match="state_snapshot_interval"):
        EngineConfig(model="/m", state_snapshot_interval=-1)
