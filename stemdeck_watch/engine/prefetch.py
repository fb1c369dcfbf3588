"""Prepare the next job while the worker separates the current one.

Separation is the slow step and the worker can serve only one job; anything else a job needs
first (a link's download; the hash and decode of a file, once the worker holds the job's
model) can run beside it (`Pipeline.prepare`). At most one job is prepared ahead: the head of
the queue, and only while another job is separating, the queue is not paused and the work fits
on disk beside the songs in flight (`DiskGuard.fits_ahead`). The prepared
job stays queued — a cancel, a move or a pause treats it exactly as if nothing had been
prepared: a cancel, a pause, the job leaving the head of the queue or its input changing (a
new signature recorded by the intake) stops the work and removes its scratch, and the
dispatcher prepares it itself if the work was dropped.

When the dispatcher takes a job that is being prepared, it adopts the work in flight: the
running job's cancel now stops it, and its progress becomes the job's progress.

The work runs at the service's own CPU priority, never lowered: a thread of this process at
SCHED_IDLE or nice 19 that holds the GIL while the worker's threads fill the cores is hardly
ever scheduled, so every other thread of the service (the worker's pipe, the intake, the
API) waits for it — 1.4 s per GIL hand-over at SCHED_IDLE and 0.27 s at nice 19, measured
here; the ten-clip run with the output steps on took 3.2x as long. Where the work beside
does not pay, `queue.work_beside = "auto"` keeps it off instead (Pipeline.works_beside).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

from stemdeck_watch.engine.diskguard import DiskGuard
from stemdeck_watch.core.errors import Cancelled
from stemdeck_watch.core.events import JobChanged, QueueChanged
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.stages.publish import remove_tree
from stemdeck_watch.engine.pipeline import Pipeline
from stemdeck_watch.engine.prepared import Prepared
from stemdeck_watch.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

NOT_AHEAD = "no longer next in the queue"
PAUSED = "the queue was paused"
CHANGED = "its input changed while it was queued"


@dataclasses.dataclass(eq=False)
class _Ahead:
    job: Job
    control: JobControl
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Prepared | None = None
    error: BaseException | None = None
    report: Callable[[float], None] | None = None  # set once the job runs

    def progress(self, value: float) -> None:
        report = self.report
        if report is not None:
            report(value)


class Prefetcher:
    def __init__(self, scheduler: Scheduler, pipeline: Pipeline, guard: DiskGuard | None = None):
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.guard = guard  # the next job is prepared only where it fits (and probed ahead)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ahead: _Ahead | None = None
        self._thread: threading.Thread | None = None
        self._unsubscribe: list[Callable[[], None]] = []

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for unsubscribe in self._unsubscribe:  # a restart after the thread died
            unsubscribe()
        bus = self.scheduler.bus
        self._unsubscribe = [
            bus.subscribe(JobChanged, self._on_job),
            bus.subscribe(QueueChanged, lambda _e: self._wake.set()),
        ]
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        self._stop.set()
        self._wake.set()
        with self._lock:
            ahead = self._ahead
        if ahead is not None:
            ahead.control.cancel("the service is stopping")
            ahead.done.wait(10)
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ the dispatcher's side

    def claim(
        self, job: Job, control: JobControl, report: Callable[[float], None]
    ) -> Prepared | None:
        """What was prepared for `job` (None if nothing was): waits for work in flight,
        which the running job's cancel now stops. Work for any other job is dropped."""
        with self._lock:
            ahead = self._ahead
            if ahead is not None and ahead.job.id != job.id:
                self._drop(ahead, NOT_AHEAD)
                ahead = None
            if ahead is None:
                return None
            ahead.report = report  # from now on the job owns the work
        try:
            with control.registered(lambda: ahead.control.cancel(control.reason or "cancelled")):
                while not ahead.done.wait(0.1):
                    control.check()
            control.check()
        finally:
            with self._lock:
                if self._ahead is ahead:
                    self._ahead = None
            self._wake.set()
        if isinstance(ahead.error, Cancelled):
            return None  # dropped before it finished: the pipeline does the work itself
        if ahead.error is not None:
            raise ahead.error
        return ahead.result

    # ------------------------------------------------------------ the loop

    def _on_job(self, event: JobChanged) -> None:
        with self._lock:
            ahead = self._ahead
            if ahead is not None and ahead.job.id == event.job.id:
                if event.job.state.is_final:
                    self._drop(ahead, event.job.error or "cancelled")  # cancelled while queued
                elif event.job.signature != ahead.job.signature:
                    # a new version (a link edited, a file replaced): prepared again from it
                    self._drop(ahead, CHANGED)
        self._wake.set()

    def _drop(self, ahead: _Ahead, reason: str) -> None:
        """Stop work nobody will claim and remove what it wrote (called under the lock)."""
        if ahead.report is not None:
            return  # the running job owns it: its own cancel decides
        ahead.control.cancel(reason)
        if ahead.done.is_set():  # finished already: nothing will clean up after it
            remove_tree(self.pipeline.settings.paths.scratch / ahead.job.id)
            if self._ahead is ahead:
                self._ahead = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._wake.wait(1.0)
                self._wake.clear()
                if not self._stop.is_set():
                    self._consider()
            except Exception:
                log.exception("preparing the next job failed; going on")

    def _consider(self) -> None:
        """Start preparing the head of the queue if a job is separating and the head needs
        preparing; drop work for a job that is no longer the head."""
        queue, registry = self.scheduler.queue, self.scheduler.registry
        order = queue.order()
        head = order[0] if order else None
        with self._lock:
            ahead = self._ahead
            running = queue.running()
            if ahead is not None:
                # taken by the dispatcher: no longer the head, but about to be claimed (the
                # job publishing behind may still hold the slot's running place meanwhile)
                taken = any(c.job_id == ahead.job.id for c in queue.in_flight())
                if not taken and (ahead.job.id != head or queue.paused):
                    self._drop(ahead, PAUSED if queue.paused else NOT_AHEAD)
                return
            current = registry.get(running.job_id) if running is not None else None
            if (
                head is None
                or queue.paused
                or current is None
                or current.state is not JobState.SEPARATING
            ):
                return
            job = registry.get(head)
            if job is None or job.state is not JobState.QUEUED:
                return
        # both look at the job's files (its choices, its length), which a share that stalls
        # holds up: off the lock, which a cancel's announcement waits for
        if not self.pipeline.can_prepare(job) or (
            self.guard is not None
            and not self.guard.fits_ahead(job, decode=job.kind is not JobKind.LINK)
        ):
            return  # looked at again when the work in flight moves on
        with self._lock:
            if (
                self._ahead is not None
                or queue.paused
                or queue.order()[:1] != [job.id]
                or registry.get(job.id) != job
            ):
                return  # changed meanwhile: looked at again at the next wake
            self._ahead = ahead = _Ahead(job, JobControl(job.id))
        log.info("preparing %s ahead while %s separates", job.name, current.name)
        threading.Thread(
            target=self._prepare, args=(ahead,), name=f"prefetch-{job.id}", daemon=True
        ).start()

    def _prepare(self, ahead: _Ahead) -> None:
        try:
            ahead.result = self.pipeline.prepare(ahead.job, ahead.control, ahead.progress)
        except BaseException as exc:  # a failure is handed to the job when it runs
            ahead.error = exc
        finally:
            with self._lock:
                ahead.done.set()
                if ahead.control.cancelled and ahead.report is None:
                    log.info(
                        "dropped the work prepared for %s: %s", ahead.job.name, ahead.control.reason
                    )
                    self._drop(ahead, ahead.control.reason or "dropped")
            self._wake.set()
