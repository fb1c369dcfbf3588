"""The event stream of the local API (`GET /api/queue/events`): one broadcaster thread listens to the event bus (its
listener only sets a flag: publishers are never delayed), takes one snapshot per batch of
events while a client is connected (none while no page is open: a song's progress would cost
a snapshot of the whole queue several times a second for nobody), and hands a frame to each
client only when the visible state changed. Progress-only
changes go out at most every PROGRESS_INTERVAL, with the latest state. Each client is served
by its own connection thread from a latest-only slot, with a socket timeout: a slow client
skips frames, a vanished one is dropped, and neither ever holds up the service or anyone else.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.events import (
    EventBus,
    JobChanged,
    JobsRestored,
    ModelDownloading,
    QueueChanged,
    QueueDrained,
)

log = logging.getLogger(__name__)

KEEPALIVE = 15.0  # seconds of silence on a stream before a comment line
PROGRESS_INTERVAL = 0.25  # progress-only frames at most ~4 per second
SETTLE = 0.03  # events of one change (a cancel: queue + job) make one frame
RECENT = 20  # finished jobs that count in the fingerprint (the page lists 15)


class Broadcaster:
    """Turns bus events into stream frames; see the module docstring."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        bus: EventBus,
        progress_interval: float = PROGRESS_INTERVAL,
        settle: float = SETTLE,
    ):
        self._snapshot, self._bus = snapshot, bus
        self._interval, self._settle = progress_interval, settle
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._lock = threading.Lock()  # the client set and the current frame
        self._refreshing = threading.Lock()  # one snapshot-compare-send at a time
        self._clients: set[StreamClient] = set()
        self._frame = b""
        self._full: Any = None
        self._shape: Any = None
        self._sent_at = 0.0
        self._unsubscribe: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self.frames_sent = 0

    def start(self) -> None:
        for kind in (JobChanged, QueueChanged, QueueDrained, JobsRestored, ModelDownloading):
            self._unsubscribe.append(self._bus.subscribe(kind, self._poke))
        self._thread = threading.Thread(target=self._run, name="stemdeck-api-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            clients, self._clients = list(self._clients), set()
        for client in clients:
            client.close()

    def attach(self) -> StreamClient:
        """A new client. Its first frame is the state as of now, ready at once (if that is
        news, the other clients get it too; no one gets it twice)."""
        client = StreamClient()
        with self._refreshing:
            if self._stopping.is_set():
                client.close()
                return client
            try:
                self._refresh(force=True)
            except Exception:
                log.exception("could not build the queue snapshot for a new stream")
            with self._lock:
                client.offer(self._frame)
                self._clients.add(client)
        return client

    def detach(self, client: StreamClient) -> None:
        with self._lock:
            self._clients.discard(client)

    def _poke(self, _event: object) -> None:
        self._wake.set()  # runs on the publisher's thread: never block here

    def _run(self) -> None:
        due: float | None = None  # when a held-back progress frame goes out
        while not self._stopping.is_set():
            timeout = None if due is None else max(0.0, due - time.monotonic())
            if self._wake.wait(timeout):
                self._stopping.wait(self._settle)
                self._wake.clear()
            if self._stopping.is_set():
                break
            with self._lock:
                watched = bool(self._clients)
            if not watched:  # no page open: no snapshot; a client's attach takes a fresh one
                due = None
                continue
            try:
                with self._refreshing:
                    due = self._refresh()
            except Exception:
                log.exception("could not build the queue snapshot for the event stream")
                due = None

    def _refresh(self, force: bool = False) -> float | None:
        """Send a frame if the visible state changed; returns when to look again if a
        progress-only frame has to wait for the rate limit (unless `force`)."""
        snap = self._snapshot()
        full, shape = fingerprints(snap)
        if full == self._full:
            return None
        now = time.monotonic()
        if not force and shape == self._shape and now - self._sent_at < self._interval:
            return self._sent_at + self._interval
        frame = b"event: queue\ndata: " + json.dumps(snap, separators=(",", ":")).encode() + b"\n\n"
        with self._lock:
            self._frame, self._full, self._shape, self._sent_at = frame, full, shape, now
            clients = list(self._clients)
            self.frames_sent += 1
        for client in clients:
            client.offer(frame)
        return None


def fingerprints(snap: dict[str, Any]) -> tuple[Any, Any]:
    """(everything a client shows, the same without progress): the running job, the queue in
    order, every job not finished (one publishing behind the next, too), the most recently
    finished ones (as the page lists them: a long queue must not push them out, or a removed
    song would stay on the page), the pause state, the waiting files and a model's download
    (whose bytes count as progress)."""
    listed = list(snap.get("jobs", []))
    final = {state.value for state in JobState if state.is_final}
    finished = sorted(
        (job for job in listed if job.get("state") in final),
        key=lambda job: -(job.get("finished_at") or job.get("created_at") or 0),
    )
    jobs = (
        [snap.get("running")]
        + list(snap.get("queued", []))
        + [job for job in listed if job.get("state") not in final]
        + finished[:RECENT]
    )
    head = (
        snap.get("paused"),
        snap.get("pause_reason"),
        json.dumps(snap.get("waiting", []), sort_keys=True),
    )
    download = snap.get("download") or {}
    full = (
        head
        + (json.dumps(download, sort_keys=True),)
        + tuple(json.dumps(job, sort_keys=True) for job in jobs)
    )
    shape = (
        head
        + (download.get("model"),)
        + tuple(
            json.dumps({k: v for k, v in job.items() if k != "progress"}, sort_keys=True)
            if job
            else "null"
            for job in jobs
        )
    )
    return full, shape


class StreamClient:
    """One stream's latest-only slot: a newer frame replaces one not yet written."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frame: bytes | None = None
        self.closed = False

    def offer(self, frame: bytes) -> None:
        with self._cond:
            self._frame = frame or None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()

    def next(self, timeout: float) -> bytes | None:
        """The next frame, or None on timeout or when closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._frame is not None or self.closed, timeout)
            frame, self._frame = self._frame, None
            return None if self.closed else frame
