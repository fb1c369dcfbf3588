"""Start a job only when its files fit: scratch (decoded input and stems) and the outbox.

A song that runs out of disk half-way wastes its separation and, on a sync folder, can leave
the machine with no room at all. So before a job starts, what it will write is estimated from
the input's duration; if either filesystem lacks that plus a margin, the queue pauses for disk
(`pause_reason = "disk"`), `disk_low` is announced, and the queue starts again by itself once
room is back. A write that still fails is a failed job like any other (nothing partial in the
outbox, the input safe).
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.events import DiskLow
from stemdeck_watch.core.jobs import Job, JobKind
from stemdeck_watch.stages.decode import probe_duration
from stemdeck_watch.stages.scratch import estimate_scratch_bytes
from stemdeck_watch.engine.scheduler import PAUSE_DISK, Scheduler

log = logging.getLogger(__name__)

MARGIN = 64 * 1024 * 1024  # never fill a disk to the last byte
UNKNOWN_SECONDS = 600.0  # a link's length before its download: assume a long song
BYTES_PER_SECOND = {"wav": {16: 176_400, 24: 264_600, 32: 352_800}, "flac": 120_000}
REMEMBERED = 64  # probed durations kept (the head of the queue and a few behind it)


class DiskGuard:
    def __init__(self, scheduler: Scheduler, settings: Settings,
                 free: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free):
        self.scheduler = scheduler
        self.settings = settings
        self._free = free
        # job id → (size, mtime_ns, seconds): probing a file's duration costs ~20 ms, which,
        # between two jobs, is worker idle time; the prefetcher probes the next job ahead
        self._durations: collections.OrderedDict[str, tuple[int, int, float]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def shortfall(self, job: Job) -> tuple[Path, int, int] | None:
        """(folder, bytes needed, bytes free) for the first filesystem the job does not fit
        on, or None when it fits."""
        seconds = self._seconds(job)
        sep, out = self.settings.for_preset(job.preset)
        stems = 6 if "6s" in sep.model else 4
        outputs = (2 if sep.two_stems else stems) + len(out.mixes)
        if out.format == "mp3":
            per_second = out.mp3_bitrate * 125
        else:
            per_second = BYTES_PER_SECOND.get(out.format, {}).get(out.bit_depth, 0) \
                if out.format == "wav" else BYTES_PER_SECOND["flac"]
        folders = self.settings.paths
        needs = {folders.scratch: estimate_scratch_bytes(seconds, stems),
                 folders.outbox: int(seconds * per_second * outputs)}
        if _same_filesystem(folders.scratch, folders.outbox):
            needs = {folders.outbox: sum(needs.values())}
        for folder, need in needs.items():
            free = self._free(_existing(folder))
            if free < need + MARGIN:
                return folder, need + MARGIN, free
        return None

    def hold(self, job: Job) -> bool:
        """True if the job must wait for room: the queue is paused for disk and told why."""
        short = self.shortfall(job)
        if short is None:
            return False
        folder, need, free = short
        log.warning("not starting %s: it needs about %s on %s, %s is free; the queue is paused "
                    "until there is room", job.name, _mb(need), folder, _mb(free))
        self.scheduler.pause(PAUSE_DISK)
        self.scheduler.bus.publish(DiskLow(str(folder), free, need))
        return True

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

    def probe(self, job: Job) -> None:
        """Learn `job`'s duration now, off the path between two jobs (the prefetcher calls
        this for the next job while the current one separates)."""
        self._seconds(job)

    def _seconds(self, job: Job) -> float:
        if job.kind is JobKind.LINK:
            return float(self.settings.links.max_duration or UNKNOWN_SECONDS)
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
        with self._lock:
            self._durations[job.id] = (st.st_size, st.st_mtime_ns, seconds)
            self._durations.move_to_end(job.id)
            while len(self._durations) > REMEMBERED:
                self._durations.popitem(last=False)
        return seconds


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
