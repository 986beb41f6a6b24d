"""The KV-event publisher: the prefix index's changes (cache/events.py) on a ZeroMQ PUB
socket in vLLM's format (wire/kv_events.py), for a cache-aware router.

The step loop only queues each step's events (a list it already built); a background
thread stamps, encodes and sends them, so a slow or absent subscriber costs the loop
nothing (PUB drops at its high-water mark; never blocks). The thread also keeps the last
``buffer_batches`` payloads for the replay socket: a router that reconnects sends the
8-byte seq it wants to resume from and gets every kept ``[seq, payload]`` from there on,
then ``[-1, b""]``.

Events carry the token ids of cached prompts: anyone who can connect reads them. Off by
default, and a bare port binds loopback only.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import structlog
import zmq

from wire.kv_events import (
    END_OF_REPLAY,
    EventBatch,
    KVEvent,
    encode_batch,
    seq_bytes,
    seq_of,
    topic,
)

log = structlog.get_logger()


CONNECT = "connect:"


def normalize_endpoint(endpoint: str) -> str:
    """``PORT`` -> ``tcp://127.0.0.1:PORT``; a full ZeroMQ address is kept."""
    return f"tcp://127.0.0.1:{endpoint}" if endpoint.isdigit() else endpoint


class KVEventPublisher:
    def __init__(self, endpoint: str, model_name: str, replay_endpoint: str = "",
                 host: str | None = None, buffer_batches: int = 10_000,
                 hwm: int = 100_000) -> None:
        self.topic = topic(model_name, host).encode()
        ctx = zmq.Context.instance()
        # Bound here, so a bad address fails the start-up; used by the thread only after.
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith(CONNECT):
            # the subscriber binds (llm-d's indexer with a static zmqEndpoint): connect to it
            self.endpoint = endpoint.removeprefix(CONNECT)
            self._pub.connect(self.endpoint)
        else:
            self._pub.bind(normalize_endpoint(endpoint))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(normalize_endpoint(replay_endpoint))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seqs = itertools.count()
        self.num_published = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (nothing when empty); returns at once."""
        if events:
            self._queue.put(EventBatch(time.time(), events))

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # still sending: its sockets go with the process
            log.warning("kv_events_unsent", seconds=timeout_s)
            return
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seqs)
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart([self.topic, seq_bytes(seq), payload], zmq.NOBLOCK)
            except zmq.Again:  # no room: PUB drops; the replay buffer still has it
                pass
            self._kept.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # [identity, b"", start] from a REQ client (vLLM's), [identity, start] from a DEALER
        identity, start = frames[0], frames[-1]
        envelope = [identity, b""] if len(frames) == 3 else [identity]
        if len(start) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        first = seq_of(start)
        for seq, payload in self._kept:
            if seq >= first:
                self._replay.send_multipart([*envelope, seq_bytes(seq), payload])
        self._replay.send_multipart([*envelope, seq_bytes(END_OF_REPLAY), b""])
