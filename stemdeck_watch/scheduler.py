"""The one door into the registry and the queue.

Intake submits stable files here; the dispatcher takes jobs and reports their progress here;
later the CLI, API and tray pause, start and cancel here. Every change is written to the
registry first and then announced on the event bus, so what listeners see is what a restart
would find.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from stemdeck_watch.config import Settings
from stemdeck_watch.events import EventBus, JobChanged, QueueChanged, QueueDrained
from stemdeck_watch.jobqueue import JobControl, JobQueue
from stemdeck_watch.jobs import ACTIVE_STATES, FileSignature, Job, JobKind, JobState, new_job_id
from stemdeck_watch.registry import Registry

log = logging.getLogger(__name__)

INPUT_REMOVED = "the input was removed from the inbox"
PAUSE_USER = "user"
PAUSE_RESTORE = "restore"


class Scheduler:
    def __init__(self, registry: Registry, queue: JobQueue, bus: EventBus, settings: Settings,
                 clock: Callable[[], float] = time.time):
        self.registry = registry
        self.queue = queue
        self.bus = bus
        self.settings = settings
        self._clock = clock
        self._lock = threading.RLock()
        # files held back by the capacity lane, in arrival order: source → (kind, since)
        self._waiting: collections.OrderedDict[str, tuple[JobKind, float]] = \
            collections.OrderedDict((s, (k, t)) for s, k, t in registry.waiting())

    # ------------------------------------------------------------ intake side

    def wants(self, source: Path, signature: FileSignature) -> bool:
        """Should a stable file at `source` become a job?

        Not if a job already holds it (a changed file keeps its place and just takes the new
        signature), nor if a finished job left the same content there (its input could not be
        moved away); any other content at that path is a new song, and so is a file dropped
        again after it was taken away.
        """
        key = str(source)
        with self._lock:
            if key in self._waiting:
                return False
            job = self.registry.latest_for_source(key)
            if job is None:
                return True
            if job.state is JobState.QUEUED:
                if job.signature != signature:
                    log.info("%s changed while queued; it keeps its place", source)
                    self.update(job.id, signature=signature)
                return False
            if job.state.is_running:
                return False
            if job.state is JobState.CANCELLED and job.error == INPUT_REMOVED:
                return True  # it was taken away and has been dropped again
            return job.signature != signature

    def submit_file(self, source: Path, rel_path: PurePosixPath,
                    signature: FileSignature) -> Job | None:
        """Queue a stable file, or hold it back as waiting when the file lane is full."""
        with self._lock:
            if self._lane_full(JobKind.FILE):
                if str(source) not in self._waiting:
                    self._waiting[str(source)] = (JobKind.FILE, self._clock())
                    self._save_waiting()
                    log.info("queue full (%d files pending): %s waits in the inbox",
                             self.settings.queue.max_pending_files, source)
                    self._announce_queue()
                return None
            job = self._create(source, rel_path, signature)
            if self.queue.paused and self.queue.pause_reason == PAUSE_RESTORE:
                log.info("a new file arrived: starting the restored queue")
                self.start()
            return job

    def _create(self, source: Path, rel_path: PurePosixPath, signature: FileSignature) -> Job:
        preset = rel_path.parts[0] if len(rel_path.parts) > 1 else None
        if preset not in self.settings.presets:
            preset = None
        name = source.stem if source.suffix else source.name
        job = self.registry.add(Job(
            id=new_job_id(), name=name, kind=JobKind.FILE, state=JobState.QUEUED,
            source=str(source), rel_path=str(rel_path), preset=preset, signature=signature))
        self.queue.put(job.id)
        self._save_order()
        log.info("queued %s as job %s%s", source, job.id, f" (preset {preset})" if preset else "")
        self.bus.publish(JobChanged(job))
        return job

    def _lane_full(self, kind: JobKind) -> bool:
        limit = (self.settings.queue.max_pending_files if kind is JobKind.FILE
                 else self.settings.queue.max_pending_links)
        pending = sum(1 for job_id in self.queue.order()
                      if (job := self.registry.get(job_id)) and job.kind is kind)
        return pending >= limit

    def admit_waiting(self) -> None:
        """Move files from waiting into the queue, in arrival order, while the lane has room."""
        with self._lock:
            changed = False
            inbox = self.settings.paths.inbox
            while self._waiting:
                source, (kind, _since) = next(iter(self._waiting.items()))
                if self._lane_full(kind):
                    break
                del self._waiting[source]
                changed = True
                path = Path(source)
                try:
                    signature = FileSignature.of(os.stat(path))
                except OSError:
                    log.info("%s left the inbox while waiting", source)
                    continue
                if self.wants(path, signature):
                    self._create(path, PurePosixPath(path.relative_to(inbox).as_posix()),
                                 signature)
            if changed:
                self._save_waiting()
                self._announce_queue()

    def file_gone(self, source: Path) -> None:
        """The input (or a folder holding inputs) left the inbox: deleted, moved away or
        renamed. Its job is cancelled — removed at once if queued, stopped if running."""
        prefix = str(source) + os.sep
        with self._lock:
            gone = [s for s in self._waiting if s == str(source) or s.startswith(prefix)]
            for waiting in gone:
                del self._waiting[waiting]
            if gone:
                self._save_waiting()
                self._announce_queue()
            jobs = [job for job in self.registry.jobs(ACTIVE_STATES)
                    if job.source == str(source) or job.source.startswith(prefix)]
        for job in jobs:
            where = self.queue.cancel(job.id, INPUT_REMOVED)
            if where == "queued":
                log.info("%s left the inbox: cancelled job %s", job.source, job.id)
                self.update(job.id, state=JobState.CANCELLED, error=INPUT_REMOVED,
                            finished_at=self._clock())
                self._save_order()
                self.admit_waiting()

    # ------------------------------------------------------------ dispatcher side

    def next_job(self, timeout: float | None = None) -> JobControl | None:
        control = self.queue.take(timeout)
        if control is not None:
            self._save_order()
            self.admit_waiting()
        return control

    def update(self, job_id: str, **fields: Any) -> Job:
        job = self.registry.update(job_id, **fields)
        self.bus.publish(JobChanged(job))
        return job

    def requeue_front(self, job_id: str) -> Job:
        job = self.update(job_id, state=JobState.QUEUED, progress=0.0, stage=None)
        self.queue.put(job_id, front=True)
        self._save_order()
        return job

    def announce_if_drained(self) -> None:
        if not self.queue.order() and not self.waiting() and self.queue.running() is None:
            self.bus.publish(QueueDrained())

    def enqueue_restored(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.queue.put(job_id)
        self._save_order()

    # ------------------------------------------------------------ control

    def pause(self, reason: str = PAUSE_USER) -> None:
        self.queue.pause(reason)
        self.registry.set_meta("pause_reason", reason)
        log.info("queue paused (%s)", reason)
        self._announce_queue()

    def start(self) -> None:
        self.queue.start()
        self.registry.set_meta("pause_reason", "")
        log.info("queue started")
        self._announce_queue()

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._waiting)

    # ------------------------------------------------------------ persistence

    def _save_order(self) -> None:
        self.registry.save_order(self.queue.order())

    def _save_waiting(self) -> None:
        self.registry.save_waiting([(s, k, t) for s, (k, t) in self._waiting.items()])

    def _announce_queue(self) -> None:
        self.bus.publish(QueueChanged(paused=self.queue.paused,
                                      pause_reason=self.queue.pause_reason,
                                      queued=tuple(self.queue.order()),
                                      waiting=len(self._waiting)))
