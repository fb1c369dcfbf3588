"""A playlist link as one job per entry (`links.playlists = true`).

The link file's own job lists the playlist when it first runs (nothing is downloaded) and
turns it into one link job per entry, queued in playlist order at the head of the queue, in
one registry transaction together with the mark on the link's job: a crash leaves either
every entry or none. The link's job goes back into the queue right after its entries, as the
playlist's last step: when it comes up again it moves the link file to `processed/` (or
`failed/` when no entry could be separated) and says how the entries ended.

Each entry is an ordinary link job, so ordering, moving, pausing, prefetching, cancelling and
restoring keep their meaning. Its input is a small `.url` file of its own in the state dir
(`playlists/<link job>/NN - Title.url`): a failed entry goes to `failed/<playlist>/` with its
report like any input and can be dropped into the inbox again on its own; a published one goes
to `processed/<playlist>/`. The link file stays in the inbox until the playlist is finished:
deleting or renaming it cancels the entries not yet done (published ones stay).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from stemdeck_watch.core.errors import Cancelled, StageError
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState, PlaylistRef, new_job_id
from stemdeck_watch.links.listing import Playlist
from stemdeck_watch.stages.naming import MAX_NAME_BYTES, sanitise
from stemdeck_watch.util.safetext import cut_to_bytes

if TYPE_CHECKING:
    from stemdeck_watch.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

FOLDER = "playlists"  # in the state dir: one folder of entry link files per playlist
ALL_CANCELLED = "every entry of the playlist was cancelled"
FINISH_WAIT = 300.0  # seconds the link's last step waits for an entry still publishing


class PlaylistError(StageError):
    stage = "playlist"


class Playlists:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.settings = scheduler.settings

    def folder(self, link_job_id: str) -> Path:
        return self.settings.paths.state / FOLDER / link_job_id

    def expanded(self, job: Job) -> bool:
        """Whether `job` is a playlist link already turned into entries (its second turn)."""
        return job.playlist is not None and job.playlist.is_link

    # ------------------------------------------------------------ first turn: list, queue

    def expand(self, job: Job, found: Playlist, control: JobControl) -> None:
        """Queue one job per entry of `found` ahead of `job`, and `job` right after them."""
        group = self.group(job)
        folder = self.folder(job.id)
        shutil.rmtree(folder, ignore_errors=True)  # a listing cut off by a crash
        folder.mkdir(parents=True)
        count = len(found.entries)
        width = max(2, len(str(count)))
        entries = []
        for number, entry in enumerate(found.entries, 1):
            name = (
                cut_to_bytes(f"{number:0{width}d} - {entry.title}", MAX_NAME_BYTES).rstrip(". ")
                + ".url"
            )
            path = folder / name
            path.write_bytes(f"[InternetShortcut]\r\nURL={entry.url}\r\n".encode())
            entries.append(
                Job(
                    id=new_job_id(),
                    name=entry.title,
                    kind=JobKind.LINK,
                    state=JobState.QUEUED,
                    source=str(path),
                    rel_path=str(group / name),
                    preset=job.preset,
                    signature=FileSignature.of(os.stat(path)),
                    playlist=PlaylistRef(job.id, job.name, number, count, entry.duration),
                )
            )
        ref = PlaylistRef(job.id, job.name, 0, count, listed=found.total)
        if not self.scheduler.expand_playlist(job.id, ref, entries, control):
            shutil.rmtree(folder, ignore_errors=True)
            raise Cancelled(control.reason or "cancelled")
        cut = (
            f"; it lists {found.total} entries, only the first {count} are queued "
            f"(links.max_entries = {self.settings.links.max_entries})"
            if found.total > count
            else ""
        )
        log.info(
            "%s is a playlist (%s): %d entries queued in order%s",
            Path(job.source).name,
            found.title,
            count,
            cut,
        )

    def group(self, job: Job) -> PurePosixPath:
        """Where a playlist's entries go inside outbox/, processed/ and failed/: a folder named
        after the link file, beside where the link file itself would go."""
        rel = PurePosixPath(job.rel_path)
        return rel.parent / (sanitise(rel.stem) or sanitise(job.name) or "playlist")

    # ------------------------------------------------------------ second turn: finish

    def finish(self, job: Job, control: JobControl) -> tuple[Path, str] | None:
        """The playlist link's job comes up again: None if entries are still to run (it goes
        back behind them); else the outbox folder of its entries and a summary, or
        PlaylistError when none could be separated, or Cancelled when all were cancelled."""
        registry = self.scheduler.registry
        deadline = time.monotonic() + FINISH_WAIT
        while True:
            entries = registry.entries_of(job.id)
            pending = [e.id for e in entries if not e.state.is_final]
            queued = set(self.scheduler.queue.order())
            if any(e in queued for e in pending):
                self.scheduler.requeue_behind(job.id, pending)
                return None
            if not pending or time.monotonic() > deadline:
                break
            # the last entry is still being published (behind the next job): wait for it
            control.wait(0.1)
        if pending:
            log.error(
                "entries %s of the playlist %s did not end within %.0f s; finishing the "
                "playlist without them",
                ", ".join(pending),
                job.name,
                FINISH_WAIT,
            )
        shutil.rmtree(self.folder(job.id), ignore_errors=True)
        done = [e for e in entries if e.state is JobState.DONE]
        failed = [e for e in entries if e.state is JobState.FAILED]
        summary = self.summary(job, entries)
        if done:
            log.info("playlist %s finished: %s", job.name, summary)
            return self.settings.paths.outbox.joinpath(*self.group(job).parts), summary
        if failed:
            raise PlaylistError(
                f"no entry of the playlist {job.name} could be separated: {summary}",
                details="\n".join(f"{e.name}: {e.error}" for e in failed),
            )
        raise Cancelled(ALL_CANCELLED)

    def summary(self, job: Job, entries: list[Job]) -> str:
        """How a playlist's entries ended, for the link's job and its notification."""
        count = {
            state: sum(1 for e in entries if e.state is state)
            for state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
        }
        parts = [f"{count[JobState.DONE]} of {len(entries)} entries published"]
        failed = [e for e in entries if e.state is JobState.FAILED]
        if failed:
            parts.append(
                f"{len(failed)} failed ("
                + "; ".join(
                    f"{e.playlist.entry if e.playlist else '?'}. {e.name}: {e.error}"
                    for e in failed[:3]
                )
                + (" …" if len(failed) > 3 else "")
                + ")"
            )
        if count[JobState.CANCELLED]:
            parts.append(f"{count[JobState.CANCELLED]} cancelled")
        ref = job.playlist
        if ref is not None and ref.listed > ref.entries:
            parts.append(
                f"{ref.listed - ref.entries} more entries left out (links.max_entries "
                f"= {self.settings.links.max_entries})"
            )
        return ", ".join(parts)

    # ------------------------------------------------------------ start-up

    def tidy(self) -> None:
        """After a restore: entries of a playlist whose link's job has ended (its link file
        was removed while the service was stopped) are cancelled, and entry folders of
        finished playlists are removed."""
        root = self.settings.paths.state / FOLDER
        if not root.is_dir():
            return
        registry = self.scheduler.registry
        for folder in root.iterdir():
            link = registry.get(folder.name)
            if link is not None and not link.state.is_final:
                continue
            reason = (link.error if link is not None else None) or ALL_CANCELLED
            self.scheduler.cancel_entries([folder.name], reason)
            if not any(not e.state.is_final for e in registry.entries_of(folder.name)):
                shutil.rmtree(folder, ignore_errors=True)
