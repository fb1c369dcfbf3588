"""The queue: an ordered deque of job ids, one consumer, pause/start, cancel.

Exactly one job runs at a time, and that is a correctness requirement rather than a tuning
choice: every job talks to the same resident Demucs worker over one stdin and one stderr, so
two jobs at once would interleave requests, read each other's progress, and a cancel of one
would kill the worker under the other (design §3).

A job taken from the deque is, for a moment, neither queued nor running. A cancel that lands
in that gap only sets the flag on the job's `JobControl`; `set_running` then refuses it and the
consumer, which owns the job by then, is the only thing that can close it out.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Callable, Iterator

from stemdeck_watch.errors import Cancelled

log = logging.getLogger(__name__)

Killer = Callable[[], None]


class JobControl:
    """The cancel switch of one taken job.

    The pipeline checks the flag between steps; a step that blocks (the worker process, a
    decode, a download) registers a killer so that a cancel stops it at once instead of
    waiting for the step to notice. After `commit()` (the stems are published) a cancel has
    nothing left to undo and is ignored.
    """

    def __init__(self, job_id: str):
        self.job_id = job_id
        self._lock = threading.Lock()
        # held while a cancel stops the registered steps: the step's owner cannot leave
        # `registered()` (and hand a half-killed worker to the next job) until they are stopped
        self._kill_lock = threading.Lock()
        self._event = threading.Event()
        self._reason: str | None = None
        self._killers: list[Killer] = []
        self._committed = False

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def cancel(self, reason: str) -> bool:
        with self._kill_lock:
            with self._lock:
                if self._committed or self._event.is_set():
                    return False
                self._reason = reason
                self._event.set()
                killers = list(self._killers)
            for kill in killers:
                try:
                    kill()
                except Exception:
                    log.exception("stopping the step of job %s failed", self.job_id)
        return True

    def check(self) -> None:
        """Raise Cancelled if a cancel was requested; the pipeline calls this between steps."""
        if self._event.is_set():
            raise Cancelled(self._reason or "cancelled")

    def commit(self) -> bool:
        """Mark the point of no return; False if a cancel got in first."""
        with self._lock:
            if self._event.is_set():
                return False
            self._committed = True
            return True

    @contextlib.contextmanager
    def registered(self, kill: Killer) -> Iterator[None]:
        """While inside, a cancel calls `kill` (also if the cancel came just before)."""
        with self._lock:
            self._killers.append(kill)
            already = self._event.is_set()
        if already:
            kill()
        try:
            yield
        finally:
            with self._kill_lock, self._lock:
                self._killers.remove(kill)


class JobQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._order: collections.deque[str] = collections.deque()
        self._paused = False
        self._pause_reason: str | None = None
        self._claimed: JobControl | None = None
        self._running: JobControl | None = None
        self._closed = False

    # ------------------------------------------------------------ producers

    def put(self, job_id: str, front: bool = False) -> None:
        with self._lock:
            if job_id in self._order:
                return
            if front:
                self._order.appendleft(job_id)
            else:
                self._order.append(job_id)
            self._changed.notify_all()

    def discard(self, job_id: str) -> bool:
        with self._lock:
            try:
                self._order.remove(job_id)
            except ValueError:
                return False
            return True

    def move(self, job_id: str, after: str | None) -> list[str] | None:
        """Put `job_id` right after `after` (first when None; last when `after` is no longer
        queued); returns the new order, or None if `job_id` is not queued."""
        with self._lock:
            if job_id not in self._order:
                return None
            self._order.remove(job_id)
            if after is None:
                self._order.appendleft(job_id)
            elif after in self._order:
                self._order.insert(self._order.index(after) + 1, job_id)
            else:
                self._order.append(job_id)
            return list(self._order)

    def cancel(self, job_id: str, reason: str) -> str | None:
        """Cancel wherever the job is: "queued" (removed), "running" or "claimed" (flag set and
        its step stopped), or None if the queue does not hold it."""
        with self._lock:
            if job_id in self._order:
                self._order.remove(job_id)
                return "queued"
            if self._running is not None and self._running.job_id == job_id:
                control, where = self._running, "running"
            elif self._claimed is not None and self._claimed.job_id == job_id:
                control, where = self._claimed, "claimed"
            else:
                return None
        control.cancel(reason)
        return where

    def cancel_running(self, reason: str) -> None:
        with self._lock:
            control = self._running or self._claimed
        if control is not None:
            control.cancel(reason)

    # ------------------------------------------------------------ the one consumer

    def take(self, timeout: float | None = None) -> JobControl | None:
        """Block until a job may start; None on timeout or when the queue is closed."""
        with self._lock:
            ready = self._changed.wait_for(
                lambda: self._closed or (not self._paused and bool(self._order)), timeout)
            if not ready or self._closed:
                return None
            control = JobControl(self._order.popleft())
            self._claimed = control
            return control

    def set_running(self, control: JobControl) -> bool:
        """False if the job was cancelled between `take` and now: the caller finalises it."""
        with self._lock:
            self._claimed = None
            if control.cancelled:
                return False
            self._running = control
            return True

    def finish(self, control: JobControl) -> None:
        with self._lock:
            if self._running is control:
                self._running = None
            if self._claimed is control:
                self._claimed = None

    # ------------------------------------------------------------ control

    def pause(self, reason: str) -> None:
        with self._lock:
            self._paused, self._pause_reason = True, reason

    def start(self) -> None:
        with self._lock:
            self._paused, self._pause_reason = False, None
            self._changed.notify_all()

    def close(self) -> None:
        """Wake the consumer for good (service shutdown)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    # ------------------------------------------------------------ views

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pause_reason(self) -> str | None:
        return self._pause_reason

    def order(self) -> list[str]:
        with self._lock:
            return list(self._order)

    def running(self) -> JobControl | None:
        with self._lock:
            return self._running or self._claimed
