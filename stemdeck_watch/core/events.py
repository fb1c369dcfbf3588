"""An in-process event bus: the pipeline says what happened, anyone may listen.

Listeners (logging, the tray, notifications, the API stream, and tests) subscribe to
event types; a listener that raises is logged and never disturbs the publisher.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, TypeVar

from stemdeck_watch.core.jobs import Job

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Event:
    pass


@dataclasses.dataclass(frozen=True)
class JobChanged(Event):
    """A job's stored record changed (state, progress, output, error)."""

    job: Job


@dataclasses.dataclass(frozen=True)
class JobRemoved(Event):
    """A finished job was removed on request: its record and outbox folder are gone."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class JobSeparated(Event):
    """The worker returned stems; says which worker process did it and how long it took."""

    job_id: str
    worker_pid: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class QueueChanged(Event):
    paused: bool
    pause_reason: str | None
    queued: tuple[str, ...]
    waiting: int


@dataclasses.dataclass(frozen=True)
class QueueFull(Event):
    """A capacity lane just filled: further files of this kind wait in the inbox. Raised once
    each time the lane fills, not for every file held back."""

    kind: str
    limit: int


@dataclasses.dataclass(frozen=True)
class QueueDrained(Event):
    """The last job ended and nothing is queued or waiting."""


@dataclasses.dataclass(frozen=True)
class JobsRestored(Event):
    """Jobs came back after a restart; `paused` says whether they wait for Start."""

    count: int
    paused: bool


@dataclasses.dataclass(frozen=True)
class DiskLow(Event):
    """The disk holding `path` (the outbox) is almost full: `free_bytes` left, below
    `threshold_bytes`; the queue pauses until there is room (raised by the disk check)."""

    path: str
    free_bytes: int
    threshold_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ModelDownloading(Event):
    """A worker downloads `model` (from separation.model_hub, before it can separate with
    it): `done` of `total` bytes (None: the hub did not say); `ended` once it is over,
    downloaded or not."""

    model: str
    done: int
    total: int | None
    ended: bool = False


@dataclasses.dataclass(frozen=True)
class ShareAway(Event):
    """One of the service's folders (`role`: inbox, outbox, processed, failed) has been
    unreachable for `seconds` — announced once, after a grace period; the queue is paused
    meanwhile if it needs that folder."""

    role: str
    path: str
    why: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class ShareBack(Event):
    """A folder announced as away answers again after `seconds`."""

    role: str
    path: str
    seconds: float


E = TypeVar("E", bound=Event)


class EventBus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[tuple[type[Event], Callable[[Event], None]]] = []

    def subscribe(self, kind: type[E], listener: Callable[[E], None]) -> Callable[[], None]:
        """Register `listener` for events of `kind`; returns a function that unsubscribes."""
        entry = (kind, listener)
        with self._lock:
            self._listeners.append(entry)  # type: ignore[arg-type]

        def unsubscribe() -> None:
            with self._lock:
                if entry in self._listeners:
                    self._listeners.remove(entry)

        return unsubscribe

    def publish(self, event: Event) -> None:
        with self._lock:
            listeners = [fn for kind, fn in self._listeners if isinstance(event, kind)]
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener %r failed on %s", listener, type(event).__name__)
