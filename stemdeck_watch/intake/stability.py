"""When a dropped file is complete: the stability rule.

A file is ready once it is non-empty and its (size, mtime_ns, inode) has not changed for
`settle_seconds` with no watcher events in between. A close-after-write event (Linux) or a
rename into place shortens the wait to `closed_settle_seconds` but is never proof on its own:
the signature must still hold still for that long, because a writer that reopens the file per
chunk closes it many times.
A zero-byte file is not bad input but an unfinished one (browsers create it before the
download lands): it waits as long as it takes.

The clock is injected, so tests step time instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.jobs import FileSignature

CLOSED_SETTLE_SECONDS = 1.0
SWEEP_SECONDS = 0.25  # every candidate is looked at this often (a tick of the intake)


@dataclasses.dataclass
class _Candidate:
    signature: FileSignature | None
    quiet_since: float
    closed: bool = False


class StabilityTracker:
    def __init__(
        self,
        settle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        closed_settle_seconds: float = CLOSED_SETTLE_SECONDS,
    ):
        self.settle_seconds = settle_seconds
        self.closed_settle_seconds = min(closed_settle_seconds, settle_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._candidates: dict[Path, _Candidate] = {}
        self._swept = float("-inf")  # when every candidate was last looked at

    def touch(self, path: Path, closed: bool | None = None) -> None:
        """A watcher event (or a scan) saw `path`: restart its quiet period. `closed`: whether
        its writer said it is done (a close after writing, a rename into place) or not (a
        write); None (a scan) says nothing about the writer and keeps what it said."""
        now = self._clock()
        with self._lock:
            candidate = self._candidates.get(path)
            if candidate is None:
                self._candidates[path] = _Candidate(None, now, bool(closed))
            else:
                candidate.quiet_since = now
                if closed is not None:
                    candidate.closed = closed

    def forget(self, path: Path) -> None:
        with self._lock:
            self._candidates.pop(path, None)
            prefix = str(path) + os.sep  # a removed folder takes its files with it
            for other in [p for p in self._candidates if str(p).startswith(prefix)]:
                del self._candidates[other]

    def pending(self) -> list[Path]:
        with self._lock:
            return list(self._candidates)

    def next_due(self) -> float | None:
        """When (on the tracker's clock) the earliest candidate that has been looked at once
        could be ready, if nothing touches it meanwhile; None when there is none. The intake
        looks then, instead of at its next tick: a song then waits `settle_seconds`, not up
        to a tick more."""
        with self._lock:
            due = [
                c.quiet_since + self._quiet_needed(c)
                for c in self._candidates.values()
                if c.signature is not None and c.signature.size > 0
            ]
        return min(due, default=None)

    def _quiet_needed(self, candidate: _Candidate) -> float:
        """Seconds a candidate must stay unchanged: shorter once its writer closed it."""
        return self.closed_settle_seconds if candidate.closed else self.settle_seconds

    def ready(self) -> list[tuple[Path, FileSignature]]:
        """Stat the candidates that may have settled (and those not looked at yet); return
        (and stop tracking) those that have. Every candidate is looked at once per
        SWEEP_SECONDS too, so a file that grows without an event restarts its wait about
        when it grew: the intake may call this every few milliseconds while a library
        settles, and 10,000 stats per call would be most of its work."""
        now = self._clock()
        sweep = now - self._swept >= SWEEP_SECONDS
        if sweep:
            self._swept = now
        with self._lock:
            items = [
                (path, candidate)
                for path, candidate in self._candidates.items()
                if sweep
                or candidate.signature is None
                or now - candidate.quiet_since >= self._quiet_needed(candidate)
            ]
        looked: list[tuple[Path, _Candidate, FileSignature | None]] = []
        for path, candidate in items:
            try:
                looked.append((path, candidate, FileSignature.of(os.stat(path))))
            except OSError:
                looked.append((path, candidate, None))
        done: list[tuple[Path, FileSignature]] = []
        with self._lock:
            for path, candidate, signature in looked:
                if self._candidates.get(path) is not candidate:
                    continue  # forgotten, or gone and tracked anew meanwhile
                if signature is None:  # gone
                    del self._candidates[path]
                    continue
                if candidate.signature is None:  # first look: never ready on one stat
                    candidate.signature = signature
                    continue
                if signature != candidate.signature:  # still being written
                    candidate.signature = signature
                    candidate.quiet_since = now
                    candidate.closed = False
                    continue
                if signature.size == 0:
                    continue
                if now - candidate.quiet_since >= self._quiet_needed(candidate):
                    del self._candidates[path]
                    done.append((path, signature))
        return done
