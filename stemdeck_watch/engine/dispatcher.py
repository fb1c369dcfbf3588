"""The single consumer: takes one job at a time from the queue and sees it to an end.

Every job that leaves the queue through here ends in exactly one of: done, failed (input
quarantined), cancelled, or back at the head of the queue (the service is stopping, the disk
is full, or the machine failed the song: engine/faults.py). The loop catches and logs
everything and goes on: one bad song must never stop the queue.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
import time
import traceback
from typing import Callable

from stemdeck_watch.core import choices
from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import SHUTDOWN, Cancelled, StageError, WorkerDied
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import Fault, Job, JobState
from stemdeck_watch.engine import faults as machine
from stemdeck_watch.stages.quarantine import quarantine
from stemdeck_watch.engine.diskguard import NO_ROOM, DiskGuard
from stemdeck_watch.engine.prefetch import Prefetcher
from stemdeck_watch.engine.recovery import find_published
from stemdeck_watch.engine.pipeline import Pipeline, Publishing
from stemdeck_watch.workers.separator import Separator
from stemdeck_watch.engine.scheduler import INPUT_REMOVED, Scheduler
from stemdeck_watch.engine.shares import ShareWatch
from stemdeck_watch.util.retry import until_stored

log = logging.getLogger(__name__)

DISK_RECHECK_SECONDS = 3.0


class Dispatcher:
    def __init__(
        self,
        scheduler: Scheduler,
        pipeline: Pipeline,
        client: Separator,
        settings: Settings,
        prefetcher: Prefetcher | None = None,
        guard: DiskGuard | None = None,
        slot: int = 0,
        record: Callable[[int, str | None], None] | None = None,
    ):
        self.scheduler = scheduler
        self.guard = guard
        self.pipeline = pipeline
        self.prefetcher = prefetcher
        self.client = client
        self.settings = settings
        # this dispatcher's worker and queue slot: one dispatcher per worker
        # (executor.workers); `record` notes each worker's state and the song it holds
        self.slot = slot
        self._record = record
        self._stop = threading.Event()
        # retired: its worker left (`executor.workers = "auto"`); it takes no more songs
        self._retired = threading.Event()
        self._thread: threading.Thread | None = None
        self._disk_checked = 0.0
        self._behind: threading.Thread | None = None  # the previous job's publish step
        self.shares: ShareWatch | None = None  # set by the service: folders on a share
        # a machine fault ended the last job: the worker is made ready again (a new process,
        # a restarted actor placed) before this dispatcher takes another song
        self._rewarm = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop,
            name="dispatcher" if self.slot == 0 else f"dispatcher-{self.slot}",
            daemon=True,
        )
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop taking jobs; a running job is cut off and goes back to the head of the queue."""
        self._stop.set()
        self.scheduler.queue.close()
        self.scheduler.queue.cancel_running(SHUTDOWN)
        self.client.shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the dispatcher did not stop within %.0f s", timeout)
        self._wait_behind(timeout)

    def retire(self) -> None:
        """Take no more songs: this dispatcher's worker left with its machine. A song it
        held ends in a machine fault (or, while the worker starts, a cut-off) and goes
        back to the queue for the other workers; `stop` still waits for it to end."""
        self._retired.set()
        self.client.shutdown()

    @property
    def retired(self) -> bool:
        return self._retired.is_set()

    def _wait_behind(self, timeout: float | None = None) -> None:
        """Wait for the previous job's publish step (one publish at a time, in order)."""
        behind = self._behind
        if behind is not None and behind is not threading.current_thread():
            behind.join(timeout)
            if behind.is_alive():
                log.error("publishing the previous song did not end within %.0f s", timeout)
            else:
                self._behind = None

    def idle(self) -> bool:
        """No job is separating or publishing here (tests, benchmarks)."""
        behind = self._behind
        return self.scheduler.queue.running() is None and (behind is None or not behind.is_alive())

    def _record_worker(self, job: str | None = None) -> None:
        """This worker's state and the song it holds (`job`, None: free) for `status`."""
        if self._record is None:
            return
        try:
            self._record(self.slot, job)
        except Exception as exc:  # status is a view: never fail a job for it
            log.warning("could not record worker %d's state for status: %s", self.slot, exc)

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        self._warm_up()
        while not self._stop.is_set() and not self._retired.is_set():
            try:
                if self._rewarm:
                    self._rewarm = False
                    self._warm_up()
                control = self.scheduler.next_job(timeout=0.5, slot=self.slot)
                if control is not None:
                    self._handle(control)
                elif self.guard is not None:
                    self._recheck_disk()
            except Exception:
                log.exception("the dispatcher loop failed; going on")
                self._stop.wait(1.0)

    def _recheck_disk(self) -> None:
        """While paused for disk, look again every few seconds."""
        now = time.monotonic()
        if now - self._disk_checked >= DISK_RECHECK_SECONDS:
            self._disk_checked = now
            assert self.guard is not None
            self.guard.room_again()

    def _warm_up(self) -> None:
        """Load the default model before the first song arrives (it takes seconds)."""
        sep = self.settings.separation
        repo = self.settings.resolve_model_repo(sep)
        try:
            self.client.ensure_model(
                sep.model, str(repo) if repo else None, precision=sep.precision
            )
            self._record_worker()
        except Cancelled:
            pass
        except Exception as exc:
            if not self._stop.is_set():
                log.error("%s", exc)

    def _handle(self, control: JobControl) -> None:
        queue = self.scheduler.queue
        job = self.scheduler.registry.get(control.job_id)
        if job is None:
            log.error("job %s was queued but is not in the registry", control.job_id)
            queue.finish(control)
            return
        if self.guard is not None and not control.cancelled:
            guard, held = self.guard, False

            def check_room() -> None:  # an error here ends the job, never leaves it taken
                nonlocal held
                held = guard.hold(job)

            if not self._conclude(job, control, check_room):
                return
            if held:
                self._cancelled(job, NO_ROOM, control)  # it waits at the head of the queue
                queue.finish(control)
                return
        if not queue.set_running(control, self.slot):
            # cancelled between take() and now: we own the job, so we close it out
            self._cancelled(job, control.reason or "cancelled", control)
            queue.finish(control)
            return
        self._record_worker(job.name)
        prefetcher = self.prefetcher
        claim = (lambda report: prefetcher.claim(job, control, report)) if prefetcher else None
        publishing: Publishing | None = None

        def separate() -> None:  # the stages that need the worker: prepare → separate
            nonlocal publishing
            try:
                publishing = self.pipeline.start(job, control, claim)
            finally:
                self._record_worker()

        if not self._conclude(job, control, separate, final=False):
            return
        assert publishing is not None
        self._wait_behind()  # publishes run one at a time, in queue order
        # marked publishing on this thread, before the next job is taken
        if not self._conclude(job, control, publishing.begin, final=False):
            return
        if not self.pipeline.works_beside(job):  # (the song before may have gone behind)
            self._conclude(job, control, publishing.finish, final=True)
            return
        # publish behind: the worker is free, so the next job may start separating while
        # this one is written out (write → publish → file the input); the queue still holds
        # it, so a cancel reaches it
        queue.publish_behind(control, self.slot)
        self._behind = threading.Thread(
            target=self._conclude,
            args=(job, control, publishing.finish, True),
            name=f"publish-{job.id}",
            daemon=True,
        )
        self._behind.start()

    def _conclude(
        self, job: Job, control: JobControl, work: Callable[[], object], final: bool = False
    ) -> bool:
        """Run `work` for the running job; True if it succeeded and was not the `final`
        step. An error ends the job (cancelled or failed, as the error says); the job's place
        in the queue is freed after its final step or its error."""
        try:
            work()
        except Cancelled as exc:
            self._cancelled(job, exc.reason, control)
        except WorkerDied as exc:  # the machine's fault, not the song's
            self._machine_fault(job, control, exc)
        except StageError as exc:
            self._failed(job, exc.stage, str(exc), exc.details)
        except Exception as exc:
            log.exception("job %s failed with an unexpected error", job.id)
            self._failed(
                job,
                "internal",
                f"unexpected error: {type(exc).__name__}: {exc}",
                traceback.format_exc(),
            )
        else:
            if not final:
                return True
        self.scheduler.queue.finish(control)
        self.scheduler.announce_if_drained()
        return False

    def _cancelled(self, job: Job, reason: str, control: JobControl | None = None) -> None:
        until_stored(
            lambda: self._record_cancel(job, reason, control), f"the end of {job.name}", self._stop
        )

    def _record_cancel(self, job: Job, reason: str, control: JobControl | None) -> None:
        """End a cancelled job, or put it back at the head of the queue (stopping, or no room
        on disk yet: the queue is paused for disk and it runs first once there is room)."""
        if reason in (SHUTDOWN, NO_ROOM):
            log.info(
                "%s %s",
                job.name,
                "was cut off by shutdown; it goes back to the head of the queue"
                if reason == SHUTDOWN
                else "waits at the head of the queue for room on disk",
            )
            self._back_to_head(job, control)
            return
        self._end_cancelled(job, reason)

    def _back_to_head(
        self, job: Job, control: JobControl | None, avoid: int | None = None, **fields: object
    ) -> None:
        """Put a taken job back at the head of the queue, recording `fields`.

        It goes back while the queue still has it taken, so a person's cancel finds it in
        one place or the other: one that came before (answered "cancelled", the job's flag
        set) takes it out of the queue again here, one that comes after finds it queued."""
        self.scheduler.requeue_front(job.id, avoid, **fields)
        asked = control.reason if control is not None and control.cancelled else None
        if asked in (None, SHUTDOWN, NO_ROOM) or not self.scheduler.queue.discard(job.id):
            return
        self._end_cancelled(job, asked)

    def _end_cancelled(self, job: Job, reason: str) -> None:
        log.info("cancelled %s: %s", job.name, reason)
        self.scheduler.update(
            job.id,
            state=JobState.CANCELLED,
            error=reason,
            stage=None,
            progress=0.0,
            finished_at=time.time(),
        )

    def _machine_fault(self, job: Job, control: JobControl, exc: WorkerDied) -> None:
        """The worker failed under the song (died, stalled, out of memory): the song goes
        back to the head of the queue for another attempt, on another worker where one is
        waiting, until the faults run past the limits (engine/faults.py); then it fails with
        every attempt's reason."""
        self._rewarm = True
        fault = machine.fault_of(exc, self._worker_name(), time.time())
        faults = (*job.faults, fault)  # `job` as it was taken: with the attempts before
        if not machine.may_retry(faults, self.settings):
            message, attempts = machine.failure(
                faults, choices.separation_choices(self.settings, job)
            )
            log.error("%s failed on every attempt: %s", job.name, attempts.replace("\n", "; "))
            self._failed(job, exc.stage, message, exc.details, faults, attempts)
            return
        log.warning(
            "%s: %s on %s; it goes back to the head of the queue for attempt %d",
            job.name,
            exc,
            fault.worker,
            len(faults) + 1,
        )

        def retry() -> None:
            self._back_to_head(job, control, avoid=self.slot, faults=faults, error=None)

        until_stored(retry, f"{job.name} for another attempt", self._stop)

    def _worker_name(self) -> str:
        """This dispatcher's worker as a fault names it."""
        info = self.client.info()
        where = info.get("hostname") or info.get("node_ip")
        if info.get("executor") == "ray":
            return f"ray worker {info.get('index', self.slot)}" + (f" on {where}" if where else "")
        return f"the local worker (pid {self.client.pids[-1] if self.client.pids else '?'})"

    def _failed(
        self,
        job: Job,
        stage: str,
        message: str,
        details: str,
        faults: tuple[Fault, ...] | None = None,
        attempts: str = "",
    ) -> None:
        published = find_published(self.settings.paths.outbox, job)
        if published is not None:
            # the song is out; only recording it failed (a registry write): record it again
            log.error(
                "%s was published to %s but recording it failed (%s); recording again",
                job.name,
                published,
                message,
            )
            # as recorded: the registry holds the signature of the version that was read
            recorded = self.scheduler.registry.get(job.id) or job
            until_stored(
                lambda: self.pipeline.file_input(recorded, Path(job.source), published),
                f"{job.name} as done",
                self._stop,
            )
            return
        if self.shares is not None and not self.shares.check("inbox"):
            # the share holding its input is away (the queue pauses): not the song's fault,
            # nor a song the user removed; it waits at the head of the queue for the share
            log.warning(
                "%s could not be read while %s: the inbox is away; it goes back to "
                "the head of the queue",
                job.source,
                stage,
            )
            until_stored(
                lambda: self.scheduler.requeue_front(job.id),
                f"{job.name} back at the head of the queue",
                self._stop,
            )
            return
        if not os.path.lexists(job.source):
            # taken away while the step ran (its delete event may still be on the way): the
            # user removed the song, so this is a cancel, with nothing to quarantine
            log.info("%s left the inbox while %s; cancelled", job.source, stage)
            self._cancelled(job, INPUT_REMOVED)
            return
        log.error("%s failed while %s: %s", job.source, stage, message)
        # the diagnosis is on record before the input moves: a crash in between still ends
        # with the input in failed/ and its report (recovery.find_quarantined)
        noted: dict[str, object] = {} if faults is None else {"faults": faults}
        current = until_stored(
            lambda: self.scheduler.update(job.id, error=message, stage=stage, **noted),
            f"why {job.name} failed",
            self._stop,
        )
        if current is None:
            return  # stopping: the input stays in the inbox and the restore retries it
        tail = self.client.stderr_tail() if stage in ("separating", "internal") else ""
        shares = self.shares
        defer = (
            None
            if shares is None
            else (
                lambda source, target, why: shares.defer_move(
                    job.id, "failed", source, target, job.signature, why
                )
            )
        )
        where = quarantine(
            current,
            self.settings.paths.failed,
            stage=stage,
            message=message,
            details=details,
            worker_tail=tail,
            worker_versions=self.client.versions,
            defer=defer,
            attempts=attempts,
        )
        until_stored(
            lambda: self.scheduler.update(
                job.id,
                state=JobState.FAILED,
                error=message,
                stage=stage,
                source=str(where),
                finished_at=time.time(),
            ),
            f"{job.name} as failed",
            self._stop,
        )
