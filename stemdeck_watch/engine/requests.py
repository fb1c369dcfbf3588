"""What a person asks of the queue by name: find a job, cancel, move, retry, remove.

The CLI (through the API), the queue page and the tray reach these through the Scheduler,
which mixes them in; each refused request raises a ControlError and changes nothing. They live
apart from the scheduler's intake and dispatcher sides only to keep each file readable.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable

from stemdeck_watch.core.errors import AmbiguousJob, Conflict, FilesystemError, JobNotFound
from stemdeck_watch.core.events import EventBus, JobRemoved
from stemdeck_watch.store.jobqueue import JobQueue
from stemdeck_watch.core.jobs import ID_PREFIX_MIN, FileSignature, Job, JobState
from stemdeck_watch.core.choices import move_sidecar
from stemdeck_watch.core.paths import move_file, report_path
from stemdeck_watch.stages import publish
from stemdeck_watch.stages.manifest import publisher_of
from stemdeck_watch.store.registry import Registry

if TYPE_CHECKING:
    from stemdeck_watch.core.config import Settings

log = logging.getLogger("stemdeck_watch.engine.scheduler")

CANCELLED_BY_USER = "cancelled by you; change the file or drop it again to queue it again"
# seconds a cancel's answer waits for a job in flight to end: its steps check for a cancel
# at least every second or so, and a cancel is answered within 2 s
CANCEL_RECORDED_WAIT = 1.5


class Requests:
    """Mixed into the Scheduler: uses its registry, queue, lock and bookkeeping."""

    registry: Registry
    queue: JobQueue
    bus: EventBus
    settings: Settings
    _lock: threading.RLock
    _clock: Callable[[], float]
    _left: set[str]
    update: Callable[..., Job]
    submit_file: Callable[..., Job | None]
    admit_waiting: Callable[[], None]
    cancel_and_close: Callable[[list[Job], str], dict[str, str | None]]
    cancel_entries: Callable[[list[str], str], None]
    _save_order: Callable[[], None]
    _announce_queue: Callable[[], None]

    def find(self, ref: str) -> Job:
        """The job a person means by `ref`: an id, a unique id prefix of at least
        ID_PREFIX_MIN characters, or a unique song name. A shorter ref is a name only: a
        song named "5" that is gone must not make `remove 5` take whichever id starts so."""
        ref = ref.strip()
        if not ref:
            raise JobNotFound("no job given: name a job by its id or its song name")
        job = self.registry.get(ref)
        if job is not None:
            return job
        matches = [
            job for job in self.registry.find(ref) if job.name == ref or len(ref) >= ID_PREFIX_MIN
        ]
        if not matches:
            raise JobNotFound(
                f"no job {ref!r}: `stemdeck-watch status` lists the jobs; name one by its "
                f"song name or at least {ID_PREFIX_MIN} characters of its id"
            )
        by_name = [job for job in matches if job.name == ref]
        active = [job for job in by_name if not job.state.is_final]
        for candidates in (active, by_name, matches):
            if len(candidates) == 1:
                return candidates[0]
            if len(candidates) > 1:
                ids = ", ".join(
                    f"{job.id} ({job.name}, {job.state.value})" for job in candidates[:6]
                )
                raise AmbiguousJob(f"{ref!r} matches several jobs: {ids}; use the id")
        raise JobNotFound(f"no job {ref!r}")  # unreachable: matches is not empty

    def cancel_job(self, job_id: str) -> Job:
        """Cancel on a person's request: the input stays where it is, and neither a rescan
        nor a restart queues it again (changing the file or dropping it again does).

        A job in flight is answered once its dispatcher has ended it on record (its step is
        stopped at its next cancel check, so that takes a moment): "cancelled" then holds
        even if the service is killed right after, instead of the restore running the song
        again. A job not ended on record within CANCEL_RECORDED_WAIT is answered as it
        stands (still running or publishing, and stopping) and logged: it ends cancelled
        when its step reaches its check, and a kill before that restores it."""
        job = self._cancel_job(job_id)
        if job.state.is_final:
            return job
        deadline = time.monotonic() + CANCEL_RECORDED_WAIT
        while any(c.job_id == job.id for c in self.queue.in_flight()):
            if time.monotonic() > deadline:
                log.warning(
                    "%s was cancelled but has not ended within %.1f s; answered as it stands",
                    job.name,
                    CANCEL_RECORDED_WAIT,
                )
                break
            time.sleep(0.02)
        return self.registry.get(job.id) or job

    def _cancel_job(self, job_id: str) -> Job:
        with self._lock:
            job = self._get(job_id)
            if job.state.is_final:
                raise Conflict(f"{job.name} is already {job.state.value}; nothing to cancel")
            where = self.cancel_and_close([job], CANCELLED_BY_USER)[job.id]
            if where is None:  # its stems are out (or going out): saying "cancelled" would lie
                job = self._get(job.id)
                raise Conflict(
                    f"{job.name} is already {job.state.value}; nothing to cancel"
                    if job.state.is_final
                    else f"{job.name} can no longer be cancelled: its stems are being published"
                )
            if where == "queued":
                job = self._get(job.id)
            if job.playlist is not None and job.playlist.is_link:
                self.cancel_entries([job.id], CANCELLED_BY_USER)
        log.info("cancelled %s (job %s) on request", job.name, job.id)
        if where == "queued":
            self.admit_waiting()
        return job

    def move(self, job_id: str, *, after: str | None = None, first: bool = False) -> list[str]:
        """Put a queued job after another one (or first); returns the order after the move.
        If `after` has left the queue meanwhile, the job goes to the end."""
        with self._lock:
            job = self._get(job_id)
            if job.state is not JobState.QUEUED:
                raise Conflict(
                    f"{job.name} is {job.state.value}, not queued; only queued jobs can be moved"
                )
            if after is not None and after == job.id:
                raise Conflict(f"cannot move {job.name} after itself")
            order = self.queue.move(job.id, after=None if first else after)
            if order is None:
                raise Conflict(f"{job.name} has just left the queue")
            self._save_order()
        self._announce_queue()
        log.info(
            "moved %s %s",
            job.name,
            "first" if first else f"after {after}" if after in order else "to the end",
        )
        return order

    def retry(self, job_id: str) -> Job | None:
        """Queue a failed or cancelled job's input again, as a new job at the end.

        A failed job's input goes back from failed/ to its place in the inbox (never over
        another file) with its sidecar, and its report is removed. Returns the new job, or None when the
        file lane is full and the input waits.
        """
        with self._lock:
            job = self._get(job_id)
            if job.state not in (JobState.FAILED, JobState.CANCELLED):
                raise Conflict(
                    f"{job.name} is {job.state.value}; only failed or cancelled jobs can be retried"
                )
            source = Path(job.source)
            if not source.is_file():
                raise Conflict(
                    f"cannot retry {job.name}: its input {source} is gone; drop the "
                    f"file into the inbox again"
                )
            latest = self.registry.latest_for_source(job.source)
            if latest is not None and latest.id != job.id:
                raise Conflict(f"{job.name} was queued again already (job {latest.id})")
            inbox = self.settings.paths.inbox
            if inbox not in source.parents:
                report, failed = report_path(source), source
                try:
                    source = move_file(source, inbox / PurePosixPath(job.rel_path), within=inbox)
                except FilesystemError as exc:
                    raise Conflict(f"cannot retry {job.name}: {exc}") from None
                report.unlink(missing_ok=True)
                # the choices (perhaps fixed) come back with it; a sidecar put in the inbox
                # for it meanwhile is the newer one, and the old one stays in failed/
                move_sidecar(failed, source)
            signature = FileSignature.of(os.stat(source))
            self._left.add(str(source))
            rel = PurePosixPath(source.relative_to(inbox).as_posix())
            new = self.submit_file(source, rel, signature)
        log.info("retrying %s as %s", job.name, new.id if new else "a waiting file")
        return new

    def remove(self, job_id: str) -> list[str]:
        """Forget a finished job: delete the outbox folder it published and leave tombstones,
        so neither orphan adoption nor a rescan brings it back. Returns what could not be
        deleted. A folder is deleted only if its manifest names the job: a duplicate's
        `output` is the original's folder, and the folder a job once published may hold
        another song by now (moved away, another published there); those stay."""
        with self._lock:
            job = self._get(job_id)
            if not job.state.is_final:
                raise Conflict(f"{job.name} is {job.state.value}; cancel it first, then remove it")
            left: list[str] = []
            own = self._published_by(job)

            def note(path: str, exc: BaseException) -> None:
                left.append(f"{path} ({exc.strerror if isinstance(exc, OSError) else exc})")

            for folder in own:
                if sys.version_info >= (3, 12):
                    shutil.rmtree(folder, onexc=lambda _f, path, exc: note(path, exc))
                else:  # `onerror` (the exception as sys.exc_info()), deprecated since 3.12
                    shutil.rmtree(folder, onerror=lambda _f, path, info: note(path, info[1]))
            if job.output and job.playlist is not None and job.playlist.is_link:
                publish.remove_if_empty(Path(job.output))  # the entries' folder
            signature: FileSignature | None
            try:
                signature = FileSignature.of(os.stat(job.source))
            except OSError:
                signature = job.signature
            # the input is kept out unless a later job (a retry, the song dropped again)
            # owns the file now: a tombstone would then stand over that job's version
            latest = self.registry.latest_for_source(job.source)
            tombstones: list[tuple[str, str, FileSignature | None]] = (
                [(job.source, "input", signature)] if latest is None or latest.id == job.id else []
            )
            if job.output and (Path(job.output) in own or not os.path.lexists(job.output)):
                tombstones.append((job.output, "output", None))
            elif job.output:
                log.info(
                    "%s is not a folder %s published (its manifest names another job, or "
                    "none); it stays",
                    job.output,
                    job.name,
                )
            self.registry.remove(job.id, tombstones)
            self._left.discard(job.source)
        log.info(
            "removed %s (job %s)%s",
            job.name,
            job.id,
            f"; could not delete {', '.join(left)}" if left else "",
        )
        self.bus.publish(JobRemoved(job.id))
        self._announce_queue()
        return left

    def _published_by(self, job: Job) -> list[Path]:
        """The outbox folders that hold what `job` published, by the job id in their
        manifests: its song folder, or a playlist link's entries' folders."""
        jobs = [job]
        if job.playlist is not None and job.playlist.is_link:
            jobs = self.registry.entries_of(job.id)
        return [
            Path(each.output)
            for each in jobs
            if each.output and publisher_of(Path(each.output)) == each.id
        ]

    def _get(self, job_id: str) -> Job:
        job = self.registry.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id!r}")
        return job
