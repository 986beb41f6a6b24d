"""The bounded waiting queue: first come, first served; preempted work goes back in front."""

from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Sequence


class QueueFullError(RuntimeError):
    """The queue is at its limit: the request is rejected as overloaded, not queued."""


class RequestQueue:
    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._seqs: OrderedDict[str, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def push(self, seq: Sequence) -> None:
        if len(self._seqs) >= self.max_requests:
            raise QueueFullError(f"the request queue is full ({self.max_requests} waiting)")
        self._seqs[seq.request_id] = seq

    def push_front(self, seq: Sequence) -> None:
        """Preempted sequences go first and may exceed the limit: they were admitted already."""
        self._seqs[seq.request_id] = seq
        self._seqs.move_to_end(seq.request_id, last=False)

    def peek(self) -> Sequence | None:
        return next(iter(self._seqs.values()), None)

    def pop(self) -> Sequence:
        return self._seqs.popitem(last=False)[1]

    def remove(self, request_id: str) -> Sequence | None:
        return self._seqs.pop(request_id, None)

    def __iter__(self):
        return iter(list(self._seqs.values()))
