"""KV events in vLLM's wire format: what a cache-aware router (llm-d's KV-cache indexer,
Dynamo's KV router) reads to know which replica holds which prefix.

One ZeroMQ message per batch of events, three frames:
  topic    ``kv@<host>@<served model name>`` (llm-d takes the pod and the model from it);
  seq      a big-endian u64, counting from 0 for each publisher (a gap: a lost batch);
  payload  msgpack ``[timestamp_seconds, [event, ...], data_parallel_rank]``.
The batch is positional (vLLM encodes it ``array_like``; llm-d decodes it as an array),
the events are maps tagged by ``"type"``: vLLM's events were positional arrays until
vllm PR #42892 made them maps, and consumers written for one broke on the other. llm-d
reads both; `decode_batch` here does too, so a test can read either revision.

Hashes are our 128-bit block hashes' low 64 bits (cache/hashing.py), sent as msgpack
unsigned ints: llm-d and Dynamo read a u64 (llm-d would take the *last* 8 bytes of a byte
string big-endian, which is not the half the ranks mirror). A router only needs them to
tell blocks apart within one replica and to chain a block to its parent.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import msgpack

MEDIUM_DEVICE = "GPU"  # vLLM's name for the device tier, whatever the device
MEDIUM_HOST = "CPU"  # the host tier, as vLLM's offloading connector names it
END_OF_REPLAY = -1  # the seq of the frame that ends a replay (its payload is empty)


@dataclass
class BlockStored:
    """Full blocks now cached in ``medium``: a chain, each block the next one's parent."""

    block_hashes: list[int]
    parent_block_hash: int | None  # of the block before the first; None: the chain's start
    token_ids: list[int]  # the tokens of every block, block_size each, in order
    block_size: int
    medium: str = MEDIUM_DEVICE


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM_DEVICE


@dataclass
class AllBlocksCleared:
    """Forget everything this publisher said before (sent first, at every start)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    ts: float  # time.time() when published
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int = 0


def topic(model_name: str, host: str | None = None) -> str:
    return f"kv@{host or socket.gethostname()}@{model_name}"


def _as_map(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids, "block_size": event.block_size,
                "lora_id": None, "medium": event.medium, "lora_name": None,
                "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes,
                "medium": event.medium, "group_idx": 0}
    assert isinstance(event, AllBlocksCleared), event
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_as_map(e) for e in batch.events],
                          batch.data_parallel_rank])


# Field order of the positional (pre-#42892) events, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _decode_event(raw: dict | list) -> KVEvent:
    if isinstance(raw, list):  # positional: [tag, field, ...], trailing defaults omitted
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        raw = {"type": tag, **dict(zip(names, raw[1:], strict=False))}
    tag = raw.get("type")
    if tag == "BlockStored":
        return BlockStored(list(raw["block_hashes"]), raw.get("parent_block_hash"),
                           list(raw["token_ids"]), int(raw["block_size"]),
                           raw.get("medium") or MEDIUM_DEVICE)
    if tag == "BlockRemoved":
        return BlockRemoved(list(raw["block_hashes"]), raw.get("medium") or MEDIUM_DEVICE)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A payload as a router reads it (positional or map-encoded batch and events)."""
    raw = msgpack.unpackb(payload)
    if isinstance(raw, dict):
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    return EventBatch(float(ts), [_decode_event(e) for e in events], int(rank or 0))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
