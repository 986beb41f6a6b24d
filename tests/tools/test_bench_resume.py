"""tools/benchmarks/resume.py's measure of a pause: the stream's last chunk before the kill
to its first after, as its client saw it."""

from __future__ import annotations

from tools.benchmarks.resume import Stream, pause_of


def test_the_pause_is_the_gap_around_the_kill() -> None:
    stream = Stream([1], arrivals=[1.0, 1.1, 1.2, 9.5, 9.6])
    assert pause_of(stream, killed_at=1.25) == (1.2, 9.5)
    assert pause_of(stream, killed_at=10.0) is None  # it ended before the kill
    assert pause_of(Stream([1], arrivals=[1.0]), killed_at=1.5) is None  # nothing after
