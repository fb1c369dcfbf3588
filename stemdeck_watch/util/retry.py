"""A job's last word must reach the registry.

A registry write can fail for a moment: a flaky share, a disk that is full until the user
frees some room. A job whose final write failed would stay `running` in the registry while no
queue holds it, stuck until the next restart. The dispatcher retries such writes instead,
with growing pauses, until they land or the service stops (then the restore at the next start
ends the job, as it does after a crash).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_PAUSE = 0.25  # seconds; doubled after each failure
LAST_PAUSE = 10.0


def until_stored(action: Callable[[], T], what: str, stop: threading.Event) -> T | None:
    """Run `action` until it succeeds; None if the service stopped first.

    Only storage errors are retried: anything else is a defect that a retry would repeat."""
    pause = FIRST_PAUSE
    while True:
        try:
            return action()
        except (sqlite3.Error, OSError) as exc:
            if stop.is_set():
                log.error(
                    "could not record %s (%s); the service is stopping, so the restore "
                    "at the next start will end it",
                    what,
                    exc,
                )
                return None
            log.error("could not record %s: %s; trying again in %.2g s", what, exc, pause)
        if stop.wait(pause):
            # one last try: a write that works now spares the restore the guesswork
            try:
                return action()
            except (sqlite3.Error, OSError) as exc:
                log.error(
                    "could not record %s (%s); the restore at the next start will end it", what, exc
                )
                return None
        pause = min(pause * 2, LAST_PAUSE)
