"""A router's side of the KV events, as llm-d's indexer or Dynamo's router would run it:
a SUB socket on the publisher, the replay socket for what it missed, and the set of
(medium, block hash) the replica holds, rebuilt from the events alone."""

from __future__ import annotations

import time

import zmq

from wire.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    seq_bytes,
    seq_of,
)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str,
                 held: dict[str, set[int]] | None = None, next_seq: int = 0) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.replay_sock = ctx.socket(zmq.DEALER)
        self.replay_sock.connect(replay_endpoint)
        # A reconnecting router keeps what it knew and asks from where it stopped.
        self.held = held if held is not None else {"GPU": set(), "CPU": set()}
        self.next_seq = next_seq
        self.topics: set[bytes] = set()
        self.num_live = self.num_replayed = 0
        self.num_events: dict[str, int] = {}
        self.stored_tokens: dict[tuple[str, int], list[int]] = {}
        self.parent: dict[int, int | None] = {}

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay_sock.close(linger=0)

    def apply(self, payload: bytes) -> None:
        for ev in decode_batch(payload).events:
            name = type(ev).__name__
            self.num_events[name] = self.num_events.get(name, 0) + 1
            if isinstance(ev, AllBlocksCleared):
                for s in self.held.values():
                    s.clear()
            elif isinstance(ev, BlockStored):
                bs = ev.block_size
                assert len(ev.token_ids) == bs * len(ev.block_hashes), "tokens of full blocks"
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert h not in self.held[ev.medium], f"{h} stored twice in {ev.medium}"
                    self.held[ev.medium].add(h)
                    self.stored_tokens[(ev.medium, h)] = ev.token_ids[i * bs:(i + 1) * bs]
                    self.parent[h] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.held[ev.medium], f"{h} removed from {ev.medium} unheld"
                    self.held[ev.medium].discard(h)

    def replay(self, start: int, timeout_s: float = 10.0) -> None:
        """Ask for every kept batch from ``start`` on and apply the ones not seen yet."""
        self.replay_sock.send(seq_bytes(start))
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.replay_sock.poll(int(max(deadline - time.monotonic(), 0) * 1000)), \
                "no answer from the replay socket"
            seq_frame, payload = self.replay_sock.recv_multipart()
            seq = seq_of(seq_frame)
            if seq == END_OF_REPLAY:
                return
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq += 1
                self.num_replayed += 1

    def drain(self, timeout_ms: int = 50) -> None:
        """Apply every live batch waiting; a gap in the seqs is filled from the replay."""
        while self.sub.poll(timeout_ms):
            topic, seq_frame, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = seq_of(seq_frame)
            if seq > self.next_seq:
                self.replay(self.next_seq)
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq += 1
                self.num_live += 1
            timeout_ms = 0

    def catch_up(self, num_published: int, timeout_s: float = 10.0) -> None:
        """Until every one of the ``num_published`` batches is applied."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq < num_published:
            assert time.monotonic() < deadline, (self.next_seq, num_published)
            self.drain(20)
            if self.next_seq < num_published:
                self.replay(self.next_seq)
