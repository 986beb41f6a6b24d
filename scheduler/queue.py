"""The bounded waiting queue, and the admission policy: fair across sessions.

Which waiting request is admitted next:

  1. preempted sequences first: they were admitted already and hold a client waiting
     mid-answer (the most recently preempted first, as before); then requests continued
     after an engine restart, in the order they came back;
  2. then the lowest `priority` value (0 by default; vLLM's convention: lower first);
  3. then round robin across sessions: each session (a request's `session_id`, else the
     request alone) has a lane, first come first served inside it, and the lane that was
     served least recently goes first. A lane that was never served counts as served
     when it appeared, so new sessions queue in arrival order and a session that just
     got a request in waits behind every session that arrived before that.

So one agent that sends a burst of fifty requests gets one in, then every other waiting
session gets one in, then it gets its second: it cannot starve the others.

The queue is bounded by requests (`max_requests`) and by the prompt tokens it holds
(`max_tokens`, 0: no bound); past either, `push` raises QueueFullError and the request
is refused as overloaded (529/429 with retry-after at the HTTP shim). A request larger
than the token bound on its own is queued when nothing else waits, so it is served
rather than refused forever. Preempted and continued sequences are not counted against the
bounds.
"""

from __future__ import annotations

import itertools
from collections import deque

from scheduler.request import Sequence


class QueueFullError(RuntimeError):
    """The queue is at its limit: the request is rejected as overloaded, not queued."""


class _Lane:
    __slots__ = ("seqs", "served_at")

    def __init__(self, served_at: int) -> None:
        self.seqs: deque[Sequence] = deque()
        self.served_at = served_at


class RequestQueue:
    def __init__(self, max_requests: int, max_tokens: int = 0) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.num_tokens = 0  # prompt tokens of the queued (not preempted) requests
        self._preempted: deque[Sequence] = deque()
        self._lanes: dict[str, _Lane] = {}
        self._lane_of: dict[str, str] = {}  # request id -> lane key
        self._clock = itertools.count()  # orders arrivals and admissions

    def __len__(self) -> int:
        return len(self._preempted) + len(self._lane_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._lane_of or any(
            s.request_id == request_id for s in self._preempted)

    def push(self, seq: Sequence) -> None:
        n = len(seq.prompt)
        if len(self._lane_of) >= self.max_requests:
            raise QueueFullError(f"the request queue is full ({self.max_requests} waiting)")
        if self.max_tokens and self.num_tokens and self.num_tokens + n > self.max_tokens:
            raise QueueFullError(
                f"the request queue is full ({self.num_tokens} prompt tokens waiting, "
                f"limit {self.max_tokens})")
        key = seq.session_id or f"request:{seq.request_id}"
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(next(self._clock))
        lane.seqs.append(seq)
        self._lane_of[seq.request_id] = key
        self.num_tokens += n

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: next in, whatever the bounds."""
        self._preempted.appendleft(seq)

    def push_resumed(self, seq: Sequence) -> None:
        """A request continued after an engine restart (GenerateRequest.resumed_output):
        the queue had taken it, or it was running, before the engine died, and a client
        waits on it; so, like a preempted one, ahead of new requests and whatever the
        bounds, in the order the continuations come."""
        self._preempted.append(seq)

    def peek(self) -> Sequence | None:
        if self._preempted:
            return self._preempted[0]
        lane = self._next_lane()
        return lane.seqs[0] if lane is not None else None

    def pop(self) -> Sequence:
        if self._preempted:
            return self._preempted.popleft()
        lane = self._next_lane()
        assert lane is not None, "pop from an empty queue"
        seq = lane.seqs.popleft()
        lane.served_at = next(self._clock)
        self._forget(seq)
        return seq

    def remove(self, request_id: str) -> Sequence | None:
        key = self._lane_of.get(request_id)
        if key is None:
            for seq in self._preempted:
                if seq.request_id == request_id:
                    self._preempted.remove(seq)
                    return seq
            return None
        lane = self._lanes[key]
        seq = next(s for s in lane.seqs if s.request_id == request_id)
        lane.seqs.remove(seq)
        self._forget(seq)
        return seq

    def __iter__(self):
        """Every waiting sequence: preempted first, then by arrival."""
        queued = sorted((s for lane in self._lanes.values() for s in lane.seqs),
                        key=lambda s: s.arrival)
        return iter(list(self._preempted) + queued)

    def _next_lane(self) -> _Lane | None:
        # O(sessions waiting): bounded by max_requests, and cheap next to a step.
        best, best_key = None, None
        for lane in self._lanes.values():
            head = lane.seqs[0]
            key = (head.priority, lane.served_at, head.arrival)
            if best_key is None or key < best_key:
                best, best_key = lane, key
        return best

    def _forget(self, seq: Sequence) -> None:
        key = self._lane_of.pop(seq.request_id)
        self.num_tokens -= len(seq.prompt)
        if not self._lanes[key].seqs:
            del self._lanes[key]  # an idle session holds no lane
