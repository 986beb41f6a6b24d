"""The one generic msgpack codec for every message in `wire/`.

A frame is msgpack of `[schema_version, type_name, [field values...]]`. Fields
are encoded positionally (smaller and faster than maps) and decoded back into
their declared types, nested dataclasses and containers included. Only plain
data crosses the wire: no pickle, no code.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from functools import cache
from typing import Any

import msgpack

from wire import client, config, control, lifecycle, step

SCHEMA_VERSION = 8  # 2: WorkerConnect carries pid and host_id; 3: guided decoding;
# 4: reasoning spans (GenerateRequest.thinking, RequestOutput.num_reasoning_tokens);
# 5: the wire/ restructure (EngineLimits, StartFailed), EngineConfig.tokenizer;
# 6: retention hints (GenerateRequest.retention, EngineConfig.max_retained_fraction),
# StepResult.timing (RankTiming, in place of forward_s), EngineConfig.null_model_forward_ms;
# 7: overlap scheduling (EngineConfig.async_scheduling, PENDING_TOKEN in chunks,
# RankTiming.share_s); 8: the disk tier (StepPlan.disk_write/disk_read, StepResult.disk_*,
# EngineConfig.disk_cache_*, EngineLimits.num_disk_blocks, WorkerReady.disk_found,
# RequestOutput.num_disk_cached_tokens)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this schema version."""


_REGISTRY: dict[str, type] = {}


def register(*classes: type) -> None:
    for cls in classes:
        assert dataclasses.is_dataclass(cls), cls
        _REGISTRY[cls.__name__] = cls


def _dataclasses_of(module) -> list[type]:
    return [v for v in vars(module).values()
            if dataclasses.is_dataclass(v) and v.__module__ == module.__name__]


for _module in (config, client, step, lifecycle, control):
    register(*_dataclasses_of(_module))


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


@cache
def _field_types(cls: type) -> list[tuple[str, Any]]:
    # names resolve in the class's own module, which imports what its fields use
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _from_plain(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(inner[0], value) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp):
        fields = _field_types(tp)
        if not isinstance(value, list) or len(value) != len(fields):
            raise ProtocolError(f"{tp.__name__}: expected {len(fields)} fields")
        return tp(**{name: _from_plain(ftp, v) for (name, ftp), v in zip(fields, value)})
    if origin is list:
        (item,) = typing.get_args(tp)
        if item in (int, float, str):
            return value
        return [_from_plain(item, v) for v in value]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(args[0], v) for v in value)
        return tuple(_from_plain(a, v) for a, v in zip(args, value))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return {_from_plain(kt, k): _from_plain(vt, v) for k, v in value.items()}
    return value


def encode(message: Any) -> bytes:
    cls = type(message)
    if cls.__name__ not in _REGISTRY:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    return msgpack.packb(
        [SCHEMA_VERSION, cls.__name__, _to_plain(message)], use_bin_type=True
    )


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
        return _from_plain(cls, body)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {name}: {exc}") from exc
