"""tools/benchmarks/resume.py's measure of a pause: the stream's longest gap between two
chunks after the kill, as its client saw it."""

from __future__ import annotations

from tools.benchmarks.resume import Stream, pause_of


def test_the_pause_is_the_longest_gap_after_the_kill() -> None:
    # the chunk at 1.3 was on its way when the engine died at 1.25
    stream = Stream([1], arrivals=[1.0, 1.1, 1.2, 1.3, 9.5, 9.6])
    assert pause_of(stream, killed_at=1.25) == (1.3, 9.5)
    assert pause_of(stream, killed_at=10.0) is None  # it ended before the kill
    assert pause_of(Stream([1], arrivals=[1.0]), killed_at=0.5) is None  # one chunk only
