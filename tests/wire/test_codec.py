"""The wire format and the shared state digest (no processes, no torch)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire import codec
from wire.client import RequestOutput, SamplingParams
from wire.codec import SCHEMA_VERSION
from wire.config import EngineConfig, SpeculativeConfig
from wire.digest import StateDigest
from wire.step import (
    AppendBlocks,
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
