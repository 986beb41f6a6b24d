"""The one generic msgpack codec for every message in `wire/`.

A frame is msgpack of `[schema_version, type_name, [field values...]]`. Fields
are encoded positionally (smaller and faster than maps) and decoded back into
their declared types, nested dataclasses and containers included. Only plain
data crosses the wire: no pickle, no code.

Each message type's converters are built once from its type hints (`_encoder`,
`_decoder`) rather than re-inspected value by value: a step plan of 256 chunks crosses
the wire every few milliseconds, and reflecting over every field of every chunk cost
more than the socket (the engine-overhead benchmark's breakdown). A part of a message that needs no
conversion (ints, strings, bytes, lists of them) is handed to msgpack as it is.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import types
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from wire import client, config, control, lifecycle, step

SCHEMA_VERSION = 19  # 2: WorkerConnect carries pid and host_id; 3: guided decoding;
# 4: reasoning spans (GenerateRequest.thinking, RequestOutput.num_reasoning_tokens);
# 5: the wire/ restructure (EngineLimits, StartFailed), EngineConfig.tokenizer;
# 6: retention hints (GenerateRequest.retention, EngineConfig.max_retained_fraction),
# StepResult.timing (RankTiming, in place of forward_s), EngineConfig.null_model_forward_ms;
# 7: overlap scheduling (EngineConfig.async_scheduling, PENDING_TOKEN in chunks,
# RankTiming.share_s); 8: every rank samples under overlap (StepResult.sampled_digest,
# RankTiming.share_s gone), KV events (EngineConfig.kv_events_endpoint,
# kv_events_replay_endpoint, served_model_name), speculative decoding
# (EngineConfig.speculative, ScheduledChunk.num_draft, StepPlan.trim) and the disk tier
# (StepPlan.disk_write/disk_read, StepResult.disk_*, EngineConfig.disk_cache_*,
# EngineLimits.num_disk_blocks, WorkerReady.disk_found, RequestOutput.num_disk_cached_tokens);
# 9: disk reads run in the background (StepPlan.disk_read carries a read id,
# StepResult.disk_read_done/disk_read_bad); 10: CacheView.disk (deepinfer-inspect cache);
# 11: guided drafts (ScheduledChunk.draft_allowed: a mask per draft row); 12: plain
# decodes column by column (StepPlan.decodes, DecodeBatch); 13: RankTiming.cpu_s,
# EngineConfig.step_channel; 14: session retention (TurnEnd, EngineConfig.session_ttl_s),
# why a prompt missed the cache (RequestOutput.uncached, UncachedTokens,
# RequestRecord.uncached, CacheView.uncached / uncached_requests), GenerateRequest.resumed_output
# (a request continued across an engine restart); 15: hybrid models' state slots
# (NewSequence.state_slot, ScheduledChunk.state_snapshots, StepPlan.state_copy/state_register,
# EngineLimits.num_state_slots/state_bytes_per_slot, EngineConfig.state_snapshot_interval,
# UncachedTokens.no_state); 16: state snapshots in the host tier (StepPlan.state_swap_out/
# state_swap_in, EngineLimits.num_host_state_slots); 17: state snapshots in the disk tier
# (StepPlan.state_disk_write/state_disk_read, StepResult.state_disk_*,
# EngineLimits.num_disk_state_slots, WorkerReady.state_disk_found); 18: the snapshot interval
# the ranks chose (EngineLimits.state_snapshot_interval; EngineConfig's 0: auto); 19: a hybrid
# model's state slots observed (EngineStats.state_usage, CacheView.state_usage, RankSnapshot
# and SchedulerSnapshot .state_slots/.state_entries, TierRequest of the state tables)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this schema version."""


_REGISTRY: dict[str, type] = {}

# A converter maps a value to its wire form or back; None stands for "as it is", so the
# containers around such a value skip it whole.
Converter = Callable[[Any], Any] | None
_PLAIN = (int, float, str, bytes, bool, type(None), Any)


def register(*classes: type) -> None:
    for cls in classes:
        assert dataclasses.is_dataclass(cls), cls
        assert all(f.init for f in dataclasses.fields(cls)), f"{cls.__name__}: init=False field"
        _REGISTRY[cls.__name__] = cls


def _dataclasses_of(module) -> list[type]:
    return [v for v in vars(module).values()
            if dataclasses.is_dataclass(v) and v.__module__ == module.__name__]


for _module in (config, client, step, lifecycle, control):
    register(*_dataclasses_of(_module))


@cache
def _field_types(cls: type) -> list[tuple[str, Any]]:
    # names resolve in the class's own module, which imports what its fields use
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _optional_inner(tp: Any) -> tuple[Any, ...] | None:
    """The non-None members of a Union type; None if `tp` is not a Union."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return None


# --- encoding ---------------------------------------------------------------------------


def _to_plain(value: Any) -> Any:
    """Any value whose type the hints do not pin down (e.g. a Union of several types)."""
    if dataclasses.is_dataclass(value):
        return _encoder(type(value))(value)
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


@cache
def _encoder(tp: Any) -> Converter:
    if dataclasses.is_dataclass(tp):
        names = [name for name, _ in _field_types(tp)]
        convs = [_encoder(ftp) for _, ftp in _field_types(tp)]
        get = operator.attrgetter(*names)
        if len(names) == 1:
            one = get
            get = lambda v: (one(v),)  # noqa: E731
        if all(c is None for c in convs):
            return get  # a tuple: msgpack packs it as an array
        pairs = [(i, c) for i, c in enumerate(convs) if c is not None]
        if len(pairs) == 1:  # e.g. RequestOutput: one optional part, None on most outputs
            (j, one_conv), = pairs

            def encode_one(value: Any) -> Any:
                out = get(value)
                if out[j] is None:
                    return out
                out = list(out)
                out[j] = one_conv(out[j])
                return out
            return encode_one

        def encode_fields(value: Any) -> list[Any]:
            out = list(get(value))
            for i, c in pairs:
                if c is not None and out[i] is not None:
                    out[i] = c(out[i])
            return out
        return encode_fields
    inner = _optional_inner(tp)
    if inner is not None:
        return _encoder(inner[0]) if len(inner) == 1 else _to_plain
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple):
        items = [_encoder(a) for a in args if a is not Ellipsis]
        if all(c is None for c in items):
            return None
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            item = items[0]
            return lambda v: [item(x) for x in v]
        return lambda v: [c(x) if c is not None else x for c, x in zip(items, v)]
    if origin is dict:
        kc, vc = (_encoder(a) for a in args)
        if kc is None and vc is None:
            return None
        return _to_plain
    if tp in _PLAIN:
        return None
    return _to_plain


def encode(message: Any) -> bytes:
    cls = type(message)
    if cls.__name__ not in _REGISTRY:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    return msgpack.packb([SCHEMA_VERSION, cls.__name__, _encoder(cls)(message)],
                         use_bin_type=True)


# --- decoding ---------------------------------------------------------------------------


@cache
def _decoder(tp: Any) -> Converter:
    if dataclasses.is_dataclass(tp):
        fields = _field_types(tp)
        n, name = len(fields), tp.__name__
        convs = [_decoder(ftp) for _, ftp in fields]
        pairs = [(i, c) for i, c in enumerate(convs) if c is not None]

        def decode_fields(value: Any) -> Any:
            if value is None:
                return None
            if not isinstance(value, list) or len(value) != n:
                raise ProtocolError(f"{name}: expected {n} fields")
            for i, c in pairs:
                if value[i] is not None:
                    value[i] = c(value[i])
            return tp(*value)
        return decode_fields
    inner = _optional_inner(tp)
    if inner is not None:
        return _decoder(inner[0]) if len(inner) == 1 else None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        item = _decoder(args[0])
        if item is None:
            return None
        return lambda v: [item(x) for x in v]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])
            return tuple if item is None else (lambda v: tuple(item(x) for x in v))
        items = [_decoder(a) for a in args]
        if all(c is None for c in items):
            return tuple
        return lambda v: tuple(c(x) if c is not None else x for c, x in zip(items, v))
    if origin is dict:
        kc, vc = (_decoder(a) for a in args)
        if kc is None and vc is None:
            return None
        kc, vc = kc or (lambda k: k), vc or (lambda x: x)
        return lambda v: {kc(k): vc(x) for k, x in v.items()}
    return None


def decode(frame: bytes) -> Any:
    try:
        version, name, body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if version != SCHEMA_VERSION:
        raise ProtocolError(
            f"schema version {version} received, this process speaks {SCHEMA_VERSION}"
        )
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}")
    try:
        return _decoder(cls)(body)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise ProtocolError(f"malformed {name}: {exc}") from exc


# --- files ------------------------------------------------------------------------------

T = TypeVar("T")


def write_file(path: Path, message: Any) -> None:
    """A message one process leaves for another in a file (the run directory's engine
    config): the frame a socket would carry, so its types come back whole, nested
    dataclasses included, where a JSON round trip hands the reader dicts."""
    path.write_bytes(encode(message))


def read_file(path: Path, cls: type[T]) -> T:
    """The message `write_file` left at `path`, which must be a `cls`."""
    message = decode(path.read_bytes())
    if not isinstance(message, cls):
        raise ProtocolError(f"{path}: a {type(message).__name__}, not a {cls.__name__}")
    return message
