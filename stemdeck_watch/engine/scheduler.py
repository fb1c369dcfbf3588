"""The one door into the registry and the queue.

Intake submits stable files here; the dispatcher takes jobs and reports their progress here;
later the CLI, API and tray pause, start and cancel here. Every change is written to the
registry first and then announced on the event bus, so what listeners see is what a restart
would find.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import unicodedata
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

from stemdeck_watch.core.choices import song_name
from stemdeck_watch.core.config import Settings
from stemdeck_watch.links.linkfile import is_link_file
from stemdeck_watch.core.events import EventBus, JobChanged, QueueChanged, QueueDrained, QueueFull
from stemdeck_watch.store.jobqueue import JobControl, JobQueue
from stemdeck_watch.core.jobs import (
    ACTIVE_STATES,
    FileSignature,
    Job,
    JobKind,
    JobState,
    PlaylistRef,
    new_job_id,
)
from stemdeck_watch.core.paths import exists_or_unreachable, is_network_filesystem
from stemdeck_watch.store.snapshot import RECENT_JOBS, build_snapshot, workers_of
from stemdeck_watch.store.registry import Registry
from stemdeck_watch.engine.requests import Requests

log = logging.getLogger(__name__)

INPUT_REMOVED = "the input was removed from the inbox"
CHANGED_WHILE_RUNNING = "the input changed while it was separated; the new version is queued"
PAUSE_USER = "user"
PAUSE_RESTORE = "restore"
PAUSE_FOLDER = "folder"
PAUSE_DISK = "disk"
PAUSE_INBOX = "inbox"  # the inbox's share is away (shares.py)
PAUSE_OUTBOX = "outbox"  # the outbox's share is away: stems wait in scratch


class Scheduler(Requests):
    def __init__(
        self,
        registry: Registry,
        queue: JobQueue,
        bus: EventBus,
        settings: Settings,
        clock: Callable[[], float] = time.time,
    ):
        self.registry = registry
        self.queue = queue
        self.bus = bus
        self.settings = settings
        self._clock = clock
        self._lock = threading.RLock()
        # files held back by the capacity lane, in arrival order: source → (kind, since)
        self._waiting: collections.OrderedDict[str, tuple[JobKind, float]] = (
            collections.OrderedDict((s, (k, t)) for s, k, t in registry.waiting())
        )
        # inputs seen leaving the inbox after their job ended: dropped again, they are new
        self._left: set[str] = set()
        self._full: set[JobKind] = set()  # lanes that announced "queue full" and are still full
        self._unsaved: list[tuple[str, JobKind, float]] = []  # waiting files not yet on disk
        self._batch = threading.local()
        self._kinds: dict[str, JobKind | None] = {}
        self._deciding: dict[JobKind, int] = {}  # jobs an intake tick made, not written yet
        self.eta: Any = None  # the service's engine.eta.Estimator: snapshots say when songs finish
        self._gone_count = 0  # deletes handled so far (see submit_file)
        self._inodes = True
        self.learn_inbox_filesystem()

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
            twin = self._other_spelling(source, signature)
            if twin is not None:
                log.info(
                    "%s is %s spelled another way (Unicode NFC/NFD), same size and time: "
                    "not separated twice (job %s); delete one of them",
                    source,
                    twin.source,
                    twin.id,
                )
                return False
            job = self.registry.latest_for_source(key)
            if job is not None and job.state.is_final and self.registry.has_pending_move(key):
                return False  # its job is done; the move out of the inbox waits for the share
            if job is None:
                # a song the user removed stays removed until its content changes
                return self.registry.tombstone(key, "input") != signature
            if job.state is JobState.QUEUED:
                if job.signature != signature:
                    log.info("%s changed while queued; it keeps its place", source)
                    self.update(job.id, signature=self._kept(signature))
                return False
            if job.state.is_running:
                if job.signature is not None and job.signature != signature:
                    # a newer version, complete now: stop separating the old one; when the
                    # cancelled job ends the intake offers the file again and it is queued
                    if self.queue.cancel(job.id, CHANGED_WHILE_RUNNING) is not None:
                        log.info("%s changed while job %s ran: cancelling it", source, job.id)
                return False
            if key in self._left or job.error == INPUT_REMOVED:
                return True  # it was taken away and has been dropped again
            return job.signature != signature

    def _other_spelling(self, source: Path, signature: FileSignature) -> Job | None:
        """A job for the same inbox path spelled in another Unicode normal form (macOS
        writes names decomposed, most others composed) with the same size and mtime: the
        same song, which must not become two jobs and two outbox folders."""
        if str(source).isascii():
            return None  # the common case: one spelling only, no lookup
        try:
            rel = source.relative_to(self.settings.paths.inbox).as_posix()
        except ValueError:
            return None
        # the jobs this intake tick made are not written yet (`admitting`)
        created: list[Job] = getattr(self._batch, "created", [])
        making = [job for job in created if job.rel_path == _nfc(rel)]
        for job in making + self.registry.with_rel_path(_nfc(rel)):
            if (
                job.source != str(source)
                and job.state is not JobState.CANCELLED
                and job.signature is not None
                and (job.signature.size, job.signature.mtime_ns)
                == (signature.size, signature.mtime_ns)
            ):
                return job
        return None

    def submit_file(
        self, source: Path, rel_path: PurePosixPath, signature: FileSignature
    ) -> Job | None:
        """Queue a stable file, or hold it back as waiting when the file lane is full.

        The file is looked at again first: a file deleted between the intake's decision and
        now (its delete event found no job to cancel) must not become a job that fails for a
        song the user removed. That look is outside the lock (on a slow share it takes
        seconds, and `status` and the controls must not wait for it); a delete handled
        meanwhile (`file_gone`) makes it look again under the lock.
        """
        gone_before = self._gone_count
        current = _signature_now(source)
        if current is None:
            return None
        with self._lock:
            if self._gone_count != gone_before:
                current = _signature_now(source)
                if current is None:
                    return None
            if current != signature or not self.wants(source, signature):
                return None  # changed again (the intake will settle it anew) or already held
            self._left.discard(str(source))
            # a new file lifts a restore-pause, whether it is queued or held back
            if self.queue.paused and self.queue.pause_reason == PAUSE_RESTORE:
                log.info("a new file arrived: starting the restored queue")
                self.start()
            kind = JobKind.LINK if is_link_file(source) else JobKind.FILE
            if self._lane_full(kind):
                if str(source) not in self._waiting:
                    self._hold(source, kind)
                return None
            return self._create(source, rel_path, signature)

    def _hold(self, source: Path, kind: JobKind) -> None:
        """`source` waits in the inbox until its lane has room. Within an intake tick
        (`admitting`) the first such file is logged and the tick ends with one line and one
        announcement for them all; alone, it is written, logged and announced at once."""
        since = self._clock()
        self._waiting[str(source)] = (kind, since)
        self._unsaved.append((str(source), kind, since))
        held: dict[JobKind, int] | None = (
            self._batch.held if getattr(self._batch, "open", False) else None
        )
        if held is not None:
            held[kind] = held.get(kind, 0) + 1
            if held[kind] > 1:
                return  # counted in the tick's line (status lists every waiting file)
        else:
            self._flush_waiting()
        log.info(
            "queue full (%d %ss pending): %s waits in the inbox",
            self._limit(kind),
            kind.value,
            source,
        )
        if held is None:
            self._announce_queue()

    def _create(self, source: Path, rel_path: PurePosixPath, signature: FileSignature) -> Job:
        preset = rel_path.parts[0] if len(rel_path.parts) > 1 else None
        if preset not in self.settings.presets:
            preset = None
        # names and paths in their composed (NFC) form: the outbox folder and processed/
        # name are the same whichever way the writer spelled them
        # without its tag group: `Song [6s].mp3` is published as `Song`
        name = _nfc(song_name(source.stem if source.suffix else source.name))
        kind = JobKind.LINK if is_link_file(source) else JobKind.FILE
        job = Job(
            id=new_job_id(),
            name=name,
            kind=kind,
            state=JobState.QUEUED,
            source=str(source),
            rel_path=_nfc(str(rel_path)),
            preset=preset,
            signature=self._kept(signature),
        )
        if getattr(self._batch, "open", False):
            self._batch.created.append(job)  # written with the tick's others (`admitting`)
            self._deciding[kind] = self._deciding.get(kind, 0) + 1
            return job
        return self._enqueue([self.registry.add(job)])[0]

    def _write_created(self) -> None:
        """The jobs this tick made, in one registry transaction, then queued and announced.
        A file deleted meanwhile (its delete found no job to cancel yet) makes none."""
        jobs: list[Job] = self._batch.created
        self._batch.created = []
        if not jobs:
            return
        with self._lock:
            try:
                if self._gone_count != self._batch.gone:
                    jobs = [job for job in jobs if _signature_now(Path(job.source)) is not None]
                self._enqueue(self.registry.add_all(jobs))
            finally:
                self._deciding.clear()

    def _enqueue(self, jobs: list[Job]) -> list[Job]:
        """Jobs written to the registry go to the end of the queue and are announced.

        Appended: no order to write. A queued job without a saved place comes last on disk,
        in arrival order (Registry.queued_order), which is where it is; rewriting every
        queued job's place per new one made a library dropped at once quadratic."""
        with self._lock:
            for job in jobs:
                self.queue.put(job.id)
                preset = f" (preset {job.preset})" if job.preset else ""
                log.info("queued %s as job %s%s", job.source, job.id, preset)
                self.bus.publish(JobChanged(job))
        return jobs

    def learn_inbox_filesystem(self) -> None:
        """Whether the inbox is on a share (looked at again when its share answers): a
        share's inode numbers change when it is mounted again, so jobs there keep none."""
        self._inodes = not is_network_filesystem(self.settings.paths.inbox)

    def _kept(self, signature: FileSignature) -> FileSignature:
        """The signature a job keeps: without the inode where the inbox is a share."""
        return signature if self._inodes else signature.without_inode()

    def refuse(self, source: Path, rel_path: PurePosixPath, reason: str) -> Job:
        """Record input that is never separated (a link out of the inbox) as a failed job,
        so `status`, the page and notifications say why; `source` is where it lies now."""
        job = self.registry.add(
            Job(
                id=new_job_id(),
                name=_nfc(source.stem if source.suffix else source.name),
                kind=JobKind.FILE,
                state=JobState.FAILED,
                source=str(source),
                rel_path=_nfc(str(rel_path)),
                error=reason,
                finished_at=self._clock(),
            )
        )
        log.warning("refused %s: %s", rel_path, reason)
        return job

    def _kind_of(self, job_id: str) -> JobKind | None:
        """A job's kind never changes: remembered, so the lane check per arriving file reads
        no registry rows (a library dropped at once asks it thousands of times)."""
        kind = self._kinds.get(job_id)
        if kind is None:
            job = self.registry.get(job_id)
            kind = self._kinds[job_id] = job.kind if job else None
        return kind

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Admit many files (one intake tick) with one registry write for the jobs it makes
        and one for the files that wait, one log line and one queue announcement for these:
        a library of 10,000 files dropped at once must not cost 10,000 disk syncs, nor wake
        every listener 10,000 times. The tick's jobs are queued and announced once written.
        A crash before the write loses nothing — the files are still in the inbox and the
        start-up scan finds them again."""
        self._batch.open = True
        self._batch.held = {}
        self._batch.created = []
        self._batch.gone = self._gone_count
        try:
            yield
        finally:
            self._batch.open = False
            try:
                self._write_created()
            finally:
                self._flush_waiting()
            held: dict[JobKind, int] = self._batch.held
            for kind, count in held.items():
                if count > 1:
                    log.info(
                        "queue full (%d %ss pending): %d more %ss wait in the inbox",
                        self._limit(kind),
                        kind.value,
                        count - 1,
                        kind.value,
                    )
            if held:
                self._announce_queue()

    def _flush_waiting(self) -> None:
        with self._lock:
            entries = [e for e in self._unsaved if e[0] in self._waiting]
            self._unsaved = []
            if entries:
                self.registry.add_waiting(entries)

    def _lane_full(self, kind: JobKind) -> bool:
        """Whether the lane has no room; announces QueueFull once each time a lane fills."""
        limit = self._limit(kind)
        # a lane holds no more jobs than the whole queue (and the jobs an intake tick is
        # making): counted job by job only when it might be full
        deciding = self._deciding.get(kind, 0)
        full = self.queue.size() + deciding >= limit and (
            sum(1 for job_id in self.queue.order() if self._kind_of(job_id) is kind) + deciding
            >= limit
        )
        if full and kind not in self._full:
            self._full.add(kind)
            self.bus.publish(QueueFull(kind.value, limit))
        elif not full:
            self._full.discard(kind)
        return full

    def _limit(self, kind: JobKind) -> int:
        return (
            self.settings.queue.max_pending_files
            if kind is JobKind.FILE
            else self.settings.queue.max_pending_links
        )

    def admit_waiting(self) -> None:
        """Move files from waiting into the queue, in arrival order, while their lane has
        room (a full file lane does not hold back a waiting link, nor the reverse)."""
        with self._lock:
            admitted: list[str] = []
            inbox = self.settings.paths.inbox
            full: set[JobKind] = set()
            for source, (kind, _since) in list(self._waiting.items()):
                if kind in full or self._lane_full(kind):
                    full.add(kind)
                    if len(full) == 2:
                        break
                    continue
                path = Path(source)
                try:
                    found = exists_or_unreachable(path)
                except OSError as exc:  # its share is away: it keeps waiting, in its place
                    log.info(
                        "%s cannot be reached (%s); it keeps waiting", source, exc.strerror or exc
                    )
                    break
                del self._waiting[source]
                admitted.append(source)
                if found is None:
                    log.info("%s left the inbox while waiting", source)
                    continue
                signature = FileSignature.of(found)
                if self.wants(path, signature):
                    self._left.discard(source)
                    self._create(path, PurePosixPath(path.relative_to(inbox).as_posix()), signature)
            if admitted:
                self._flush_waiting()
                self.registry.remove_waiting(admitted)
                self._announce_queue()

    def file_gone(self, source: Path) -> None:
        """The input (or a folder holding inputs) left the inbox: deleted, moved away or
        renamed. Its job is cancelled — removed at once if queued, stopped if running."""
        prefix = str(source) + os.sep
        with self._lock:
            self._gone_count += 1
            gone = [s for s in self._waiting if s == str(source) or s.startswith(prefix)]
            for waiting in gone:
                del self._waiting[waiting]
            if gone:
                self._flush_waiting()
                self.registry.remove_waiting(gone)
                self._announce_queue()
            jobs = [
                job
                for job in self.registry.jobs(ACTIVE_STATES)
                if job.source == str(source) or job.source.startswith(prefix)
            ]
            self._note_left(source, prefix)
        cancelled = self.cancel_and_close(jobs, INPUT_REMOVED)
        for job in jobs:
            if cancelled[job.id] == "queued":
                log.info("%s left the inbox: cancelled job %s", job.source, job.id)
        if "queued" in cancelled.values():
            self.admit_waiting()
        # a playlist link taken away takes its entries not yet done with it
        self.cancel_entries(
            [job.id for job in jobs if job.playlist is not None and job.playlist.is_link],
            INPUT_REMOVED,
        )

    def cancel_and_close(self, jobs: list[Job], reason: str) -> dict[str, str | None]:
        """Cancel each of `jobs` for `reason`; returns where each one was (JobQueue.cancel).

        A queued job leaves the queue and ends here, cancelled on record. A running or
        publishing one is stopped, and its dispatcher ends it. One whose stems are already
        going out (None) is left to finish: saying "cancelled" would lie."""
        where = {job.id: self.queue.cancel(job.id, reason) for job in jobs}
        closed = [job_id for job_id, place in where.items() if place == "queued"]
        for job_id in closed:
            self.update(job_id, state=JobState.CANCELLED, error=reason, finished_at=self._clock())
        if closed:
            self._save_order()
        return where

    def cancel_entries(self, link_job_ids: list[str], reason: str) -> None:
        """Cancel the entries of these playlist links that are not done yet: queued ones are
        removed at once, a running one is stopped; published entries stay published."""
        for link_id in link_job_ids:
            entries = [e for e in self.registry.entries_of(link_id) if not e.state.is_final]
            cancelled = self.cancel_and_close(entries, reason)
            for entry in entries:
                if cancelled[entry.id] is not None:
                    log.info(
                        "cancelled entry %s of the playlist %s: %s",
                        entry.name,
                        entry.playlist.name if entry.playlist else link_id,
                        reason,
                    )

    def expand_playlist(
        self, link_id: str, ref: PlaylistRef, entries: list[Job], control: JobControl
    ) -> bool:
        """Queue a playlist link's entries in playlist order at the head of the queue and the
        link's own job right behind them (it finishes the playlist). One registry transaction
        writes them all with the link's mark; False (nothing written) if the link was
        cancelled or taken away meanwhile — checked under the lock that `file_gone` holds."""
        with self._lock:
            link = self.registry.get(link_id)
            if control.cancelled or link is None or not os.path.exists(link.source):
                return False
            # their places are saved in the same transaction: a crash right after must not
            # restore the entries behind jobs that were queued after the playlist
            order = (
                [entry.id for entry in entries]
                + [link_id]
                + [job_id for job_id in self.queue.order() if job_id != link_id]
            )
            self.registry.add_all(
                entries,
                then=(
                    link_id,
                    {"playlist": ref, "state": JobState.QUEUED, "progress": 0.0, "stage": None},
                ),
                order=order,
            )
            self.queue.put(link_id, front=True)
            for entry in reversed(entries):
                self.queue.put(entry.id, front=True)
        for entry in entries:
            self.bus.publish(JobChanged(entry))
        self.bus.publish(JobChanged(self._get(link_id)))
        self._announce_queue()
        return True

    def requeue_behind(self, job_id: str, others: list[str]) -> None:
        """Put a job back into the queue right behind the last of `others` there (a playlist
        link whose entries were moved behind it waits for them)."""
        with self._lock:
            self.update(job_id, state=JobState.QUEUED, progress=0.0, stage=None)
            self.queue.put(job_id)
            order = self.queue.order()
            last = max((order.index(other) for other in others if other in order), default=None)
            if last is not None:
                self.queue.move(job_id, after=order[last])
            self._save_order()
        self._announce_queue()

    def _note_left(self, source: Path, prefix: str) -> None:
        """Remember inputs of finished jobs that left the inbox: dropped again, the same
        content is a new request (a retry), not the file the finished job already saw."""
        inbox = str(self.settings.paths.inbox) + os.sep
        if not str(source).startswith(inbox):
            return
        if self.registry.latest_for_source(str(source)) is not None:
            self._left.add(str(source))
        for key in self.registry.sources_under(prefix):
            self._left.add(key)

    # ------------------------------------------------------------ dispatcher side

    def next_job(self, timeout: float | None = None, slot: int = 0) -> JobControl | None:
        control = self.queue.take(timeout, slot)
        if control is not None:
            # the job is taken whatever happens next: a failed write here must not drop it.
            # The order on disk still has it first, so a restore finds it where it was.
            try:
                self._save_order()
                self.admit_waiting()
            except Exception:
                log.exception(
                    "could not record the queue after taking job %s; going on", control.job_id
                )
        return control

    def update(self, job_id: str, **fields: Any) -> Job:
        job = self.registry.update(job_id, **fields)
        self.bus.publish(JobChanged(job))
        return job

    def requeue_front(self, job_id: str, avoid: int | None = None, **fields: Any) -> Job:
        """A taken job goes back to the head of the queue (stopping, no disk room yet, or a
        machine fault: `avoid` is the slot whose worker failed it, `fields` what to record),
        behind any job taken before it that went back too."""
        job = self.update(job_id, state=JobState.QUEUED, progress=0.0, stage=None, **fields)
        self.queue.put_back(job_id, avoid)
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
    # The CLI (through the API), the page and the tray all steer the queue through these
    # calls and nothing else. A refused request raises a ControlError and changes nothing.

    def pause(self, reason: str = PAUSE_USER) -> None:
        with self._lock:
            if self.queue.paused and self.queue.pause_reason == reason:
                return
            self.queue.pause(reason)
            self.registry.set_meta("pause_reason", reason)
        log.info("queue paused (%s)", reason)
        self._announce_queue()

    def start(self) -> None:
        """Start the queue, whatever paused it (the user, a restore, the PAUSE file)."""
        with self._lock:
            if not self.queue.paused:
                return
            self.queue.start()
            self.registry.set_meta("pause_reason", "")
        log.info("queue started")
        self._announce_queue()

    def snapshot(self) -> dict[str, Any]:
        """The live `status --json` object (the API's GET /api/queue), as small with a
        history of 20,000 songs as with none: older jobs are paged (`jobs_page`).

        Without the scheduler's lock and without a filesystem call: whoever holds the lock
        may be waiting on a slow share, and status must answer at once. The waiting list
        is copied in one C-level step (no other thread runs meanwhile). The estimate reads
        a few songs' headers, never while the inbox's share is away."""
        waiting = [(s, k, t) for s, (k, t) in _copy(self._waiting)]
        jobs, older = self.registry.recent(RECENT_JOBS)
        order = self.queue.order()
        snap = build_snapshot(
            jobs,
            order,
            waiting,
            self.queue.pause_reason if self.queue.paused else None,
            self.settings.paths,
            {"running": True, "pid": os.getpid()},
            workers=workers_of(self.registry),
            older=older,
            pending=self.registry.pending_moves(),
        )
        if self.eta is not None:
            snap["eta"] = self._estimate(jobs, order, snap["worker"])
        return snap

    def estimate(self) -> dict[str, Any] | None:
        """The snapshot's `eta` alone (what the estimator keeps in the registry for
        `status`), without the rest of a snapshot: no status object per job and no waiting
        list, which for a library dropped at once are tens of thousands of objects."""
        if self.eta is None:
            return None
        jobs, _older = self.registry.recent(RECENT_JOBS)
        workers = workers_of(self.registry)
        return self._estimate(jobs, self.queue.order(), workers[0] if workers else None)

    def _estimate(
        self, jobs: list[Job], order: list[str], worker: dict[str, Any] | None
    ) -> dict[str, Any]:
        by_id = {job.id: job for job in jobs}
        paused = self.queue.pause_reason if self.queue.paused else None
        result: dict[str, Any] = self.eta.estimate(
            [job for job in jobs if job.state.is_running],
            [by_id[i] for i in order if i in by_id],
            jobs,
            worker,
            paused=paused is not None,
            probe=paused != PAUSE_INBOX,
        )
        return result

    def jobs_page(
        self, before: tuple[float, int] | None, limit: int
    ) -> tuple[list[Job], tuple[float, int] | None]:
        """Every job, newest first, a page at a time (GET /api/jobs)."""
        return self.registry.page(before, limit)

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._waiting)

    def sources_in_flight(self) -> list[str]:
        """The inputs of the jobs not ended yet, and of the files waiting for the lane: what
        the intake checks is still there after a time it could not see deletions."""
        jobs = self.registry.jobs(ACTIVE_STATES)
        return list(dict.fromkeys([job.source for job in jobs] + self.waiting()))

    # ------------------------------------------------------------ persistence

    def _save_order(self) -> None:
        # read and written under the lock: two savers must not store an older order last.
        # A job just taken but not started yet is still "queued" on disk: it keeps the head,
        # or a crash in that instant would restore it last.
        # With publish behind, the job taken can sit beside a job still publishing: every
        # job in flight that is still "queued" on disk keeps the head.
        with self._lock:
            order = self.queue.order()
            for taken in reversed(self.queue.in_flight()):
                job = self.registry.get(taken.job_id)
                if taken.job_id not in order and job is not None and job.state is JobState.QUEUED:
                    order.insert(0, taken.job_id)
            self.registry.save_order(order)

    def _announce_queue(self) -> None:
        self.bus.publish(
            QueueChanged(
                paused=self.queue.paused,
                pause_reason=self.queue.pause_reason,
                queued=tuple(self.queue.order()),
                waiting=len(self._waiting),
            )
        )


def _signature_now(source: Path) -> FileSignature | None:
    try:
        return FileSignature.of(os.stat(source))
    except OSError:
        log.info("%s left the inbox before it was queued", source)
        return None


def _copy(
    items: collections.OrderedDict[str, tuple[JobKind, float]],
) -> list[tuple[str, tuple[JobKind, float]]]:
    for _ in range(10):
        try:
            return list(items.items())
        except RuntimeError:  # changed during the copy: take it again
            continue
    return []


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)
