"""Start a job only when its files fit: scratch (decoded input and stems) and the outbox.

A song that runs out of disk half-way wastes its separation and, on a sync folder, can leave
the machine with no room at all. So before a job starts, what it will write is estimated from
the input's duration; if either filesystem lacks that plus a margin, the queue pauses for disk
(`pause_reason = "disk"`), `disk_low` is announced, and the queue starts again by itself once
room is back. Only where the disk is short for every song, though: a song whose own choices (a
sidecar's or a tag's practice renders, stem file, formats) need more than the disk has, where
it would fit as configured, fails alone with the reason naming them. A write that still fails is a failed job like any other (nothing partial in the
outbox, the input safe).

The check counts the work beside the worker too: a song still publishing behind, a song
prepared ahead, another worker's song, each with what it has still to write (its estimate
less what its scratch and staging folders hold already). Preparing ahead asks first
(`fits_ahead`) and waits where it does not fit, without pausing anything. A link is sized by
its own length where that is known (a playlist's entry, the download once it is there):
before its download only the download's room is checked, and once the download is there the
job is checked again (`admit_download`).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.choices import ChoiceError, for_job, settings_for
from stemdeck_watch.core.config import OutputSettings, SeparationSettings, Settings
from stemdeck_watch.core.dropgate import is_dropped
from stemdeck_watch.core.errors import Cancelled
from stemdeck_watch.core.events import DiskLow
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.stages.decode import probe_duration
from stemdeck_watch.stages.scratch import estimate_scratch_bytes
from stemdeck_watch.stages.songfolder import extra_bytes
from stemdeck_watch.engine.scheduler import PAUSE_DISK, Scheduler

log = logging.getLogger(__name__)

MARGIN = 64 * 1024 * 1024  # never fill a disk to the last byte
UNKNOWN_SECONDS = 600.0  # a length nothing tells: assume a long song
BYTES_PER_SECOND = {"wav": {16: 176_400, 24: 264_600, 32: 352_800}, "flac": 120_000}
DOWNLOAD_BYTES_PER_SECOND = 40_000  # 320 kbit/s: the richest audio stream sites commonly give
REMEMBERED = 64  # probed durations kept (the head of the queue and a few behind it)
NO_ROOM = "waiting for room on disk"  # a Cancelled's reason: the job goes back to the head
Planned = tuple[SeparationSettings, OutputSettings]  # the settings a job's estimate is for


class DiskGuard:
    def __init__(
        self,
        scheduler: Scheduler,
        settings: Settings,
        free: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free,
    ):
        self.scheduler = scheduler
        self.settings = settings
        self._free = free
        # job id → (size, mtime_ns, seconds): probing a file's duration costs ~20 ms, which,
        # between two jobs, is worker idle time; the prefetcher probes the next job ahead.
        # A link's entry is its download's length, learned once it is downloaded.
        self._durations: collections.OrderedDict[str, tuple[int, int, float]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._waiting: str | None = None  # the job last told to wait to be prepared ahead

    def shortfall(self, job: Job, whole: bool = True) -> tuple[Path, int, int] | None:
        """(folder, bytes needed, bytes free) for the first filesystem `job` does not fit on
        beside the work already in flight, or None when it fits. `whole`: the job's every
        step; else (a link not yet downloaded) only its download."""
        return self._short(self._needed(job, whole, self._beside(job)))

    def hold(self, job: Job) -> bool:
        """True if the job must wait for room: the queue is paused for disk and told why.
        Raises ChoiceError, pausing nothing, where the disk is short only for this song's
        own choices (a sidecar's or a tag's): as configured it would fit, with them it
        cannot fit even alone, so waiting would hold every song behind it for nothing."""
        short = self.shortfall(job)
        if short is None:
            return False
        self._refuse_own_choices(job)
        folder, need, free = short
        log.warning(
            "not starting %s: it needs about %s on %s, %s is free; the queue is paused "
            "until there is room",
            job.name,
            _mb(need),
            folder,
            _mb(free),
        )
        self.scheduler.pause(PAUSE_DISK)
        self.scheduler.bus.publish(DiskLow(str(folder), free, need))
        return True

    def admit_download(self, job: Job, download: Path) -> None:
        """A link's download is there: learn its length, and check the job again with it.
        Raises Cancelled(NO_ROOM) after pausing the queue for disk where it does not fit
        (the dispatcher puts the job back at the head; its length is remembered, so it is
        not downloaded again before there is room)."""
        self.learn_download(job, download)
        if self.hold(job):
            raise Cancelled(NO_ROOM)

    def learn_download(self, job: Job, download: Path) -> None:
        """Remember a link's length, probed from its download."""
        seconds = probe_duration(download)
        self._remember(job.id, (0, 0, UNKNOWN_SECONDS if seconds is None else seconds))

    def fits_ahead(self, job: Job, decode: bool = True) -> bool:
        """Whether `job` may be prepared ahead now: decoded (`decode`), or only downloaded
        (a link), beside everything in flight. Nothing is paused or announced where it does
        not fit: the job is looked at again as the work in flight moves on, and checked as
        usual when it runs."""
        short = self.shortfall(job, whole=decode)
        if short is None:
            self._waiting = None
            return True
        if self._waiting != job.id:  # said once per job, not at every look
            self._waiting = job.id
            folder, need, free = short
            log.info(
                "not preparing %s ahead: beside the songs in flight it needs about %s on "
                "%s, %s is free",
                job.name,
                _mb(need),
                folder,
                _mb(free),
            )
        return False

    def room_again(self) -> bool:
        """While paused for disk: start the queue again once its head fits."""
        queue = self.scheduler.queue
        if not (queue.paused and queue.pause_reason == PAUSE_DISK):
            return False
        order = queue.order()
        head = self.scheduler.registry.get(order[0]) if order else None
        if head is not None and self.shortfall(head) is not None:
            return False
        log.info("there is room on disk again: starting the queue")
        self.scheduler.start()
        return True

    def _refuse_own_choices(self, job: Job) -> None:
        """Fail `job` (ChoiceError naming what its drop chose) if the disk is short for its
        own choices alone: the song as configured fits beside the work in flight, and with
        its choices it does not fit even with nothing beside it."""
        try:
            chosen = for_job(self.settings, job)
        except ChoiceError:
            return  # it fails on them when it starts
        dropped = {k: o for k, o in chosen.origins.items() if is_dropped(o)}
        if not dropped:
            return
        if self._short(self._needed(job, True, self._beside(job), as_configured=True)):
            return  # short for every song: the queue waits for room
        alone = self._short(self._needed(job, True, []))
        if alone is None:
            return  # it fits once the work beside it is done
        folder, need, free = alone
        origins = " and the ".join(dict.fromkeys(dropped.values()))
        raise ChoiceError(
            f"{job.name}: what the {origins} chose ({', '.join(dropped)}) needs about "
            f"{_mb(need)} on {folder}, {_mb(free)} is free: more than this disk has for "
            f"one song (as configured it would fit); choose less there, or make room and "
            f"retry it"
        )

    # ------------------------------------------------------------ what a job still needs

    def _beside(self, job: Job) -> list[Job]:
        """The jobs in flight other than `job`: taken by a worker, or holding a scratch or
        staging folder (publishing behind, prepared ahead)."""
        folders = self.settings.paths
        ids = {control.job_id for control in self.scheduler.queue.in_flight()}
        for folder in (folders.scratch, folders.staging):
            try:
                with os.scandir(folder) as entries:
                    ids.update(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                pass
        ids.discard(job.id)
        found = (self.scheduler.registry.get(job_id) for job_id in sorted(ids))
        return [other for other in found if other is not None and not other.state.is_final]

    def _needed(
        self, job: Job, whole: bool, beside: list[Job], as_configured: bool = False
    ) -> dict[Path, int]:
        """Bytes still to be written on each filesystem by `job` and the jobs beside it;
        `as_configured`: `job` without what its drop chose (its preset's settings)."""
        needs = self._remaining(job, whole, as_configured)
        for other in beside:
            for folder, need in self._remaining(other, True).items():
                needs[folder] = needs.get(folder, 0) + need
        return needs

    def _short(self, needs: dict[Path, int]) -> tuple[Path, int, int] | None:
        for folder, need in needs.items():
            try:
                free = self._free(_existing(folder))
            except OSError as exc:  # a share that is away: the publish step waits for it
                log.info("could not see the free space on %s (%s)", folder, exc.strerror or exc)
                continue
            if free < need + MARGIN:
                return folder, need + MARGIN, free
        return None

    def _remaining(self, job: Job, whole: bool, as_configured: bool = False) -> dict[Path, int]:
        """What `job` has still to write: its estimate less what its scratch and staging
        folders hold already (a song prepared ahead, one half published)."""
        folders = self.settings.paths
        scratch, staging = folders.scratch / job.id, folders.staging / job.id
        if job.state is JobState.PUBLISHING and not (
            os.path.lexists(scratch) or os.path.lexists(staging)
        ):
            return {}  # published: nothing left to write
        download = scratch / "download"
        fetched = _size(download)
        seconds = self._seconds(job)
        scratch_need = max(0, self._download_bytes(job, seconds) - fetched)
        outbox_need = 0
        if whole and seconds is not None:
            planned = (
                self.settings.for_preset(job.preset)
                if as_configured
                else settings_for(self.settings, job)
            )
            scratch_need += max(
                0, self._scratch_bytes(planned, seconds) - (_size(scratch) - fetched)
            )
            outbox_need = max(0, self._outbox_bytes(planned, seconds) - _size(staging))
        if _same_filesystem(folders.scratch, folders.outbox):
            return {folders.outbox: scratch_need + outbox_need}
        return {folders.scratch: scratch_need, folders.outbox: outbox_need}

    def _download_bytes(self, job: Job, seconds: float | None) -> int:
        """Room for a link's download: its length (else the longest accepted) at a rich
        audio stream's rate, at most links.max_filesize."""
        if job.kind is not JobKind.LINK:
            return 0
        links = self.settings.links
        size = int((seconds or links.max_duration or UNKNOWN_SECONDS) * DOWNLOAD_BYTES_PER_SECOND)
        return min(size, links.max_filesize) if links.max_filesize else size

    def _scratch_bytes(self, planned: Planned, seconds: float) -> int:
        sep, _out = planned
        stems = 6 if "6s" in sep.model else 4
        # a recipe holds, at its peak, the RoFormer's vocals, the instrumental and the
        # Demucs model's own stems beside the "other" written from them (workers/recipe.py)
        return estimate_scratch_bytes(seconds, stems + (3 if sep.recipe else 0))

    def _outbox_bytes(self, planned: Planned, seconds: float) -> int:
        """The stems and mixes in the chosen format (the DAW projects' mix too), and what the
        optional outputs add (a DJ stem file, practice renders)."""
        sep, out = planned
        stems = 6 if "6s" in sep.model else 4
        # a DAW project plays the whole song as a mix on a muted track
        outputs = (2 if sep.two_stems else stems) + len(out.mixes) + bool(out.session)
        if out.format == "mp3":
            per_second = out.mp3_bitrate * 125
        else:
            per_second = (
                BYTES_PER_SECOND.get(out.format, {}).get(out.bit_depth, 0)
                if out.format == "wav"
                else BYTES_PER_SECOND["flac"]
            )
        return int(seconds * per_second * outputs) + extra_bytes(stems, out, seconds)

    def _seconds(self, job: Job) -> float | None:
        """The job's length; None for a link whose length nothing has told yet."""
        if job.kind is JobKind.LINK:
            with self._lock:
                learned = self._durations.get(job.id)
            if learned is not None:
                return learned[2]
            entry = job.playlist
            return float(entry.duration) if entry is not None and entry.duration else None
        try:
            st = os.stat(job.source)
        except OSError:
            return UNKNOWN_SECONDS  # gone or unreadable: the decode step will say why
        with self._lock:
            known = self._durations.get(job.id)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return known[2]
        probed = probe_duration(Path(job.source))  # None: the decode step will say why
        seconds = UNKNOWN_SECONDS if probed is None else probed
        self._remember(job.id, (st.st_size, st.st_mtime_ns, seconds))
        return seconds

    def _remember(self, job_id: str, known: tuple[int, int, float]) -> None:
        with self._lock:
            self._durations[job_id] = known
            self._durations.move_to_end(job_id)
            while len(self._durations) > REMEMBERED:
                self._durations.popitem(last=False)


def _size(folder: Path) -> int:
    """Bytes the files under `folder` hold (0 if it is not there)."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    total += _size(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _existing(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(_existing(a)).st_dev == os.stat(_existing(b)).st_dev
    except OSError:
        return False


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"
