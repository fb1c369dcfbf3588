"""How fast a worker goes, as measured: the time per segment, and what follows from it.

A worker reports progress once per model segment (the Ray actor at most every 0.1 s), so the
gap between two reports is the time of one segment (or of a few, when they are that short).
That measure sets how long a silent worker is given before it counts as stalled
(`separation.stall_seconds`, by default a generous multiple of it, never under a minute) and
how long a Ray worker is given to stop a cancelled song on its own before it is killed (one
segment and a margin): a slow CPU worker is neither killed while it works nor waited on
forever when it hangs.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

STALL_FACTOR = 10.0  # a silent worker is stalled after this many segments' time …
STALL_FLOOR = 60.0  # … and never before this many seconds (the default)
GRACE_FACTOR = 1.5  # a cancel may wait this many segments' time for a cooperative stop …
GRACE_MARGIN = 1.0  # … plus this many seconds (the answer's way back)
GRACE_UNMEASURED = 5.0  # … or this long before any segment was measured on the worker
GRACE_FLOOR = 0.6
KEPT = 3  # separations whose slowest segment is remembered


class Pace:
    """The measured time per segment of one worker on one device."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._slowest: collections.deque[float] = collections.deque(maxlen=KEPT)

    @property
    def segment_seconds(self) -> float | None:
        """The slowest segment of the last few separations (None before the first)."""
        with self._lock:
            return max(self._slowest) if self._slowest else None

    def stall_limit(self, setting: float) -> float:
        """Seconds without progress after which the worker counts as stalled: `setting`
        (`separation.stall_seconds`), or with 0 the default measured here."""
        if setting > 0:
            return setting
        return max(STALL_FLOOR, STALL_FACTOR * (self.segment_seconds or 0.0))

    def cancel_grace(self) -> float:
        """Seconds a cancelled separation may take to stop on its own before the worker is
        killed: about one segment (it stops between segments) and a margin."""
        segment = self.segment_seconds
        if segment is None:
            return GRACE_UNMEASURED
        return max(GRACE_FLOOR, GRACE_FACTOR * segment + GRACE_MARGIN)

    def watch(self, limit: float) -> Watch:
        """A watch over one separation that stalls after `limit` silent seconds."""
        return Watch(self, limit)

    def _record(self, slowest: float) -> None:
        with self._lock:
            self._slowest.append(slowest)


class Watch:
    """One separation's progress reports: when the last came, the gaps between them."""

    def __init__(self, pace: Pace, limit: float):
        self.pace = pace
        self.limit = limit
        self.started = self.last = pace.clock()
        self._slowest = 0.0
        self._reports = 0

    def beat(self) -> None:
        """A progress report arrived (any thread)."""
        now = self.pace.clock()
        if self._reports:  # the first gap holds the set-up (upload, statistics), not a segment
            self._slowest = max(self._slowest, now - self.last)
        self._reports += 1
        self.last = now

    def silent(self) -> float:
        """Seconds since the last report (or the start)."""
        return self.pace.clock() - self.last

    def stalled(self) -> bool:
        return self.silent() > self.limit

    def stalled_reason(self, where: str = "", doing: str = "") -> str:
        """What a stalled worker's fault says, wherever it ran (`where`: " on HOST")."""
        return (
            f"the separation worker{where} reported no progress for {self.silent():.0f} s"
            f"{' ' + doing if doing else ''} (the stall limit is {self.limit:.0f} s, "
            f"separation.stall_seconds) and was stopped"
        )

    def done(self) -> None:
        """The separation ended well: its slowest segment counts toward the pace."""
        if self._reports > 1:
            self.pace._record(self._slowest)
