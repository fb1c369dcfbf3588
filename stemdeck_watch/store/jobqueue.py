"""The queue: an ordered deque of job ids, one consumer, pause/start, cancel.

Exactly one job runs at a time, and that is a correctness requirement rather than a tuning
choice: every job talks to the same resident Demucs worker over one stdin and one stderr, so
two jobs at once would interleave requests, read each other's progress, and a cancel of one
would kill the worker under the other.

With several workers (`executor.workers`, the Ray executor) there is one consumer per
worker, each with its own slot: a slot holds at most one taken job, so "one job at a time"
becomes "one job per worker". With one consumer (slot 0) nothing differs.

A job taken from the deque is, for a moment, neither queued nor running. A cancel that lands
in that gap only sets the flag on the job's `JobControl`; `set_running` then refuses it and the
consumer, which owns the job by then, is the only thing that can close it out.

A job whose publish step runs behind the worker leaves its slot to the next job but stays in
flight until it finishes: a cancel must still reach its own `JobControl`, which decides (until
its `commit()`) whether there is anything left to cancel.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
from typing import Callable, Iterator

from stemdeck_watch.core.errors import Cancelled

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
        self.taken = 0  # when the queue handed it out (a count): earlier was ahead in the queue
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

    def wait(self, seconds: float) -> None:
        """Pause up to `seconds`; a cancel ends the pause at once and raises Cancelled."""
        self._event.wait(seconds)
        self.check()

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
        # the same ids as a set: "is it queued?" in one step, not a walk of the whole queue
        # (a library dropped at once queues thousands, each asking once)
        self._queued: set[str] = set()
        self._paused = False
        self._pause_reason: str | None = None
        # per consumer slot (one per worker): the job taken and the job running there
        self._claimed: dict[int, JobControl] = {}
        self._running: dict[int, JobControl] = {}
        # jobs that left their slot to publish behind the worker, until they finish
        self._behind: list[JobControl] = []
        self._takes = itertools.count(1)
        # jobs put back at the head after being taken: job id -> when it had been taken
        self._returned: dict[str, int] = {}
        # jobs put back after a machine fault: job id -> the slot whose worker failed it,
        # which leaves it to another worker waiting for a job
        self._avoid: dict[str, int] = {}
        self._idle: set[int] = set()  # slots waiting in take() now
        self._closed = False

    # ------------------------------------------------------------ producers

    def put(self, job_id: str, front: bool = False) -> None:
        with self._lock:
            if job_id in self._queued:
                return
            self._returned.pop(job_id, None)
            self._avoid.pop(job_id, None)
            if front:
                self._order.appendleft(job_id)
            else:
                self._order.append(job_id)
            self._queued.add(job_id)
            self._changed.notify_all()

    def put_back(self, job_id: str, avoid: int | None = None) -> None:
        """Return a taken job to the head of the queue, behind every job that was taken
        before it and went back too: a stop cuts off the song publishing behind and the one
        separating at once, in whatever order their threads get there, and they must come
        back in the order they were queued.

        `avoid`: the slot whose worker failed the job (a machine fault); while another
        slot is waiting for a job, that one takes it."""
        with self._lock:
            if avoid is not None:
                self._avoid[job_id] = avoid
            if job_id in self._queued:
                return
            taken = next((c.taken for c in self._controls() if c.job_id == job_id), 0)
            at = 0
            while (
                at < len(self._order)
                and self._order[at] in self._returned
                and self._returned[self._order[at]] < taken
            ):
                at += 1
            self._order.insert(at, job_id)
            self._queued.add(job_id)
            self._returned[job_id] = taken
            self._changed.notify_all()

    def discard(self, job_id: str) -> bool:
        with self._lock:
            self._avoid.pop(job_id, None)
            if job_id not in self._queued:
                return False
            self._order.remove(job_id)
            self._queued.discard(job_id)
            return True

    def move(self, job_id: str, after: str | None) -> list[str] | None:
        """Put `job_id` right after `after` (first when None; last when `after` is no longer
        queued); returns the new order, or None if `job_id` is not queued."""
        with self._lock:
            if job_id not in self._queued:
                return None
            self._order.remove(job_id)
            if after is None:
                self._order.appendleft(job_id)
            elif after in self._queued:
                self._order.insert(self._order.index(after) + 1, job_id)
            else:
                self._order.append(job_id)
            return list(self._order)

    def cancel(self, job_id: str, reason: str) -> str | None:
        """Cancel wherever the job is: "queued" (removed), "running", "claimed" or
        "publishing" (behind the worker: flag set and its step stopped), or None if there is
        nothing to cancel: the queue does not hold it, or its stems are already going out
        (committed)."""
        with self._lock:
            if job_id in self._queued:
                self._order.remove(job_id)
                self._queued.discard(job_id)
                return "queued"
            found = [
                (c, where)
                for table, where in (
                    (self._running.values(), "running"),
                    (self._claimed.values(), "claimed"),
                    (self._behind, "publishing"),
                )
                for c in table
                if c.job_id == job_id
            ]
            if not found:
                return None
            control, where = found[0]
        if not control.cancel(reason) and not control.cancelled:
            return None  # committed: the song is out, the cancel changes nothing
        return where

    def cancel_running(self, reason: str) -> None:
        """Cancel every job in flight: taken, running or publishing behind, on every
        worker."""
        for control in self.in_flight():
            control.cancel(reason)

    # ------------------------------------------------------------ the one consumer

    def take(self, timeout: float | None = None, slot: int = 0) -> JobControl | None:
        """Block until a job may start; None on timeout or when the queue is closed.
        `slot`: the consumer's (its worker's) slot."""
        with self._lock:
            self._idle.add(slot)
            try:
                ready = self._changed.wait_for(
                    lambda: self._closed or self._ready_for(slot), timeout
                )
            finally:
                self._idle.discard(slot)
            if not ready or self._closed:
                return None
            control = JobControl(self._order.popleft())
            self._queued.discard(control.job_id)
            self._avoid.pop(control.job_id, None)
            control.taken = next(self._takes)
            # every job still queued was behind this one: a job put back before now no
            # longer orders the ones put back later
            self._returned.clear()
            self._claimed[slot] = control
            return control

    def _ready_for(self, slot: int) -> bool:
        """A job may start on `slot`: the queue runs and holds one, and it is not one this
        slot's worker failed while another slot waits for a job."""
        if self._paused or not self._order:
            return False
        return self._avoid.get(self._order[0]) != slot or not (self._idle - {slot})

    def set_running(self, control: JobControl, slot: int = 0) -> bool:
        """False if the job was cancelled between `take` and now: the caller finalises it,
        then calls `finish` (until then the job stays taken, in its place among those taken)."""
        with self._lock:
            if control.cancelled:
                return False
            if self._claimed.get(slot) is control:
                del self._claimed[slot]
            self._running[slot] = control
            return True

    def publish_behind(self, control: JobControl, slot: int = 0) -> None:
        """The job's worker part is over: its slot takes the next job while it publishes,
        and it stays in flight (cancels reach it) until `finish`."""
        with self._lock:
            if self._running.get(slot) is control:
                del self._running[slot]
            if control not in self._behind:
                self._behind.append(control)

    def finish(self, control: JobControl) -> None:
        with self._lock:
            for table in (self._running, self._claimed):
                for slot in [s for s, c in table.items() if c is control]:
                    del table[slot]
            if control in self._behind:
                self._behind.remove(control)

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

    def size(self) -> int:
        """Jobs queued (not taken), without copying the order."""
        with self._lock:
            return len(self._order)

    def running(self) -> JobControl | None:
        """The first worker's job (running, else taken, else publishing behind); None when
        no job is in flight."""
        with self._lock:
            return (
                next(iter(self._running.values()), None)
                or next(iter(self._claimed.values()), None)
                or next(iter(self._behind), None)
            )

    def in_flight(self) -> list[JobControl]:
        """Every job taken, running or publishing behind, on every worker, in the order they
        were taken (their order in the queue)."""
        with self._lock:
            controls = self._controls()
        return sorted({id(c): c for c in controls}.values(), key=lambda c: c.taken)

    def _controls(self) -> list[JobControl]:
        return [*self._running.values(), *self._claimed.values(), *self._behind]
