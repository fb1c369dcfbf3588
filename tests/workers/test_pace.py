"""The measured pace of a worker: the stall limit and the Ray cancel grace follow the time per
segment measured on it."""

from __future__ import annotations

import pytest

from stemdeck_watch.workers.pace import GRACE_UNMEASURED, STALL_FLOOR, Pace


class Clock:
    """A clock moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def separation(pace: Pace, clock: Clock, gaps: list[float]) -> None:
    """One separation whose progress reports come `gaps` seconds apart."""
    watch = pace.watch(pace.stall_limit(0))
    for gap in [0.5, *gaps]:  # the first gap is the set-up: it is not a segment
        clock.now += gap
        watch.beat()
    watch.done()


def test_before_any_measure_the_defaults_hold() -> None:
    pace = Pace()
    assert pace.segment_seconds is None
    assert pace.stall_limit(0) == STALL_FLOOR and pace.stall_limit(5.0) == 5.0
    assert pace.cancel_grace() == GRACE_UNMEASURED


def test_the_limits_follow_the_slowest_segment_measured() -> None:
    clock = Clock()
    pace = Pace(clock)
    separation(pace, clock, [0.1, 0.1, 0.2])  # a fast worker: the floors hold
    assert pace.segment_seconds == pytest.approx(0.2)
    assert pace.stall_limit(0) == STALL_FLOOR
    assert pace.cancel_grace() == pytest.approx(1.5 * 0.2 + 1.0)
    separation(pace, clock, [2.8, 3.1, 2.9])  # a full-size model on a CPU: ~3 s a segment
    assert pace.segment_seconds == pytest.approx(3.1)
    assert pace.stall_limit(0) == STALL_FLOOR
    assert pace.cancel_grace() == pytest.approx(1.5 * 3.1 + 1.0)
    separation(pace, clock, [9.0, 8.0])  # a slower machine still: ten segments' time
    assert pace.stall_limit(0) == pytest.approx(90.0)
    assert pace.stall_limit(20.0) == 20.0  # separation.stall_seconds, as set


def test_a_watch_stalls_after_its_limit_of_silence() -> None:
    clock = Clock()
    watch = Pace(clock).watch(60.0)
    clock.now += 59.0
    assert not watch.stalled()
    watch.beat()
    clock.now += 60.5
    assert watch.stalled() and watch.silent() == pytest.approx(60.5)
