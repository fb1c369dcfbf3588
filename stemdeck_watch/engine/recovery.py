"""Start-up restore: decide the fate of every job the last run left unfinished.

A job cut off by a crash, a power cut or a kill is in one of three situations:
- its song folder was published (the crash hit between the rename and the registry write):
  it is done — separating it again would only make a duplicate;
- it was cut off half-way: partial output is removed and it goes back to the head of the queue,
  with its attempt count written *before* it runs again;
- it was already cut off `queue.resume_attempts` times: it fails, so a song that takes the
  machine down every time cannot wedge the queue.
Restored jobs wait in a paused queue: opening the computer must not start hours of separation
on its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path, PurePosixPath
from typing import Callable, Container, Iterator

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.events import JobsRestored
from stemdeck_watch.core.jobs import (
    RUNNING_STATES,
    Job,
    JobKind,
    JobState,
    new_job_id,
    settings_key_of,
)
from stemdeck_watch.core.paths import (
    exists_or_unreachable,
    find_moved,
    numbered_siblings,
    report_path,
)
from stemdeck_watch.stages.publish import remove_tree
from stemdeck_watch.stages.manifest import MANIFEST, read_manifest
from stemdeck_watch.stages.quarantine import quarantine
from stemdeck_watch.engine.scheduler import INPUT_REMOVED, PAUSE_RESTORE, PAUSE_USER, Scheduler

log = logging.getLogger(__name__)


def find_published(outbox: Path, job: Job) -> Path | None:
    """The outbox folder a job published, found by the job id in its manifest.

    Every `name`, `name (N)` sibling is looked at, not just the run of existing numbers: the
    job may have published to `song (2)` while `song` existed, and `song` may be gone now;
    so is every numbered sibling of each folder above it (an album folder named like a song
    published before it is published beside it, see publish_folder).
    """
    parents = [outbox]
    for part in PurePosixPath(job.rel_path).parent.parts:
        parents = [
            sibling
            for parent in parents
            for sibling in numbered_siblings(parent / part, keep_suffix=False)
        ]
    for parent in parents:
        for folder in numbered_siblings(parent / job.name, keep_suffix=False):
            manifest = read_manifest(folder)
            if manifest and manifest.get("job_id") == job.id:
                return folder
    return None


def find_quarantined(failed: Path, job: Job) -> Path | None:
    """The input of a job that was moved into failed/ just before a crash."""
    if job.signature is None:
        return None
    return find_moved(
        failed / PurePosixPath(job.rel_path), job.signature.size, job.signature.mtime_ns
    )


def restore(
    scheduler: Scheduler,
    settings: Settings,
    finish: Callable[[Job, Path, Path], Job],
    unreachable: Callable[[str], bool] = lambda _source: False,
) -> int:
    """Requeue what the last run left; returns how many jobs wait in the queue again.
    `unreachable(source)`: the input's share is away (not mounted yet), so a missing input
    says nothing about the song."""
    registry = scheduler.registry
    folders = settings.paths
    limit = settings.queue.resume_attempts
    front: list[str] = []
    # two jobs can be in flight (one publishing behind the next one's separation): the one
    # publishing was ahead in the queue, so it goes back first
    in_flight = sorted(
        registry.jobs(RUNNING_STATES),
        key=lambda j: (j.state is not JobState.PUBLISHING, j.created_at),
    )
    for job in in_flight:
        remove_tree(folders.staging / job.id)
        remove_tree(folders.scratch / job.id)
        published = find_published(folders.outbox, job)
        if published is not None:
            log.info("%s was published before the restart: marking it done", job.name)
            finish(job, Path(job.source), published)
        elif not (unreachable(job.source) or _may_be_there(job.source)):
            moved = find_quarantined(folders.failed, job)
            if moved is None:
                scheduler.update(
                    job.id, state=JobState.CANCELLED, error=INPUT_REMOVED, finished_at=time.time()
                )
            else:
                # it failed and was quarantined, then the crash hit before the registry write
                message = job.error or "failed just before the service stopped"
                if not report_path(moved).exists():
                    quarantine(
                        dataclasses.replace(job, source=str(moved)),
                        folders.failed,
                        stage=job.stage or "restart",
                        message=message,
                    )
                scheduler.update(
                    job.id,
                    state=JobState.FAILED,
                    error=message,
                    source=str(moved),
                    finished_at=time.time(),
                )
        elif job.attempts >= limit:
            times = "twice" if limit == 1 else f"{limit + 1} times"
            message = f"interrupted by a restart {times} — drop the file again to retry"
            where = quarantine(job, folders.failed, stage=job.stage or "restart", message=message)
            scheduler.update(
                job.id,
                state=JobState.FAILED,
                error=message,
                source=str(where),
                finished_at=time.time(),
            )
            log.error("%s: %s", job.name, message)
        else:
            # the attempt is counted before the job runs again
            scheduler.update(
                job.id, state=JobState.QUEUED, attempts=job.attempts + 1, progress=0.0, stage=None
            )
            front.append(job.id)
    queued = []
    for job_id in registry.queued_order():
        if job_id in front:
            continue
        job = registry.get(job_id)
        if job is not None and not (unreachable(job.source) or _may_be_there(job.source)):
            scheduler.update(
                job_id, state=JobState.CANCELLED, error=INPUT_REMOVED, finished_at=time.time()
            )
        else:
            queued.append(job_id)
    _remove_leftovers(folders.scratch)
    order = front + queued
    scheduler.enqueue_restored(order)
    previous_pause = registry.get_meta("pause_reason")
    paused = False
    if previous_pause == PAUSE_USER:
        scheduler.pause(PAUSE_USER)
        paused = True
    elif order and settings.queue.start_paused_after_restore:
        scheduler.pause(PAUSE_RESTORE)
        paused = True
    elif previous_pause:
        scheduler.start()
    if order:
        log.info(
            "%d job(s) restored%s",
            len(order),
            " — the queue is paused: press Start, or drop a new file" if paused else "",
        )
        scheduler.bus.publish(JobsRestored(len(order), paused))
    return len(order)


def _may_be_there(source: str) -> bool:
    """Whether a job's input is there, or cannot be reached (its share is away at start-up):
    only "not there" makes a job whose input was removed."""
    try:
        return exists_or_unreachable(source) is not None
    except OSError as exc:
        log.warning("%s cannot be reached (%s); its job is kept", source, exc.strerror or exc)
        return True


def _remove_leftovers(scratch: Path) -> None:
    if scratch.is_dir():
        for entry in scratch.iterdir():
            remove_tree(entry)


def adopt_orphans(scheduler: Scheduler, settings: Settings) -> int:
    """Adopt outbox song folders the registry does not know as done jobs; returns how many.

    A registry restored from a backup, rebuilt after damage, or a crash at the wrong instant
    leaves published songs without a job: adopted, they count as separated (no duplicate work)
    and show in `status`. A folder whose manifest is damaged or incomplete is left alone and
    named in the log; a folder the user removed (a tombstone) never comes back.
    """
    registry = scheduler.registry
    folders = settings.paths
    known = registry.outputs()
    adopted = 0
    for folder in _song_folders(folders.outbox, known):
        if str(folder) in known or registry.tombstone(str(folder), "output") is not False:
            continue
        manifest = read_manifest(folder)  # only for folders nobody knows: start-up stays fast
        if manifest is None:
            log.warning("%s has a damaged or incomplete stemdeck.json; leaving it alone", folder)
            continue
        job_id = str(manifest.get("job_id") or new_job_id())
        if registry.get(job_id) is not None:
            continue  # its job published it under another name: already accounted for
        source = manifest.get("input")
        source = source if isinstance(source, dict) else {}  # a manifest written by anyone
        rel_path = str(source.get("rel_path") or folder.name)
        processed = folders.processed / PurePosixPath(rel_path)
        registry.add(
            Job(
                id=job_id,
                name=folder.name,
                kind=JobKind.LINK if "link" in manifest else JobKind.FILE,
                state=JobState.DONE,
                source=str(processed),
                rel_path=rel_path,
                preset=manifest.get("preset"),
                progress=1.0,
                output=str(folder),
                finished_at=folder.stat().st_mtime,
                sha256=source.get("sha256"),
                settings_key=settings_key_of(manifest.get("settings")),
            )
        )
        adopted += 1
    if adopted:
        log.info("adopted %d song folder(s) in the outbox that the registry did not know", adopted)
    return adopted


def _song_folders(outbox: Path, known: Container[str] = ()) -> Iterator[Path]:
    """Every folder holding a stemdeck.json (not below it), except the `known` ones.

    Known song folders are not even listed: with 10,000 songs in the outbox, listing each
    was most of the start-up time."""
    for root, dirs, files in os.walk(outbox):
        # staging and hidden folders, and song folders the registry already has
        dirs[:] = [d for d in dirs if not d.startswith(".") and os.path.join(root, d) not in known]
        if MANIFEST in files:
            dirs[:] = []
            yield Path(root)
