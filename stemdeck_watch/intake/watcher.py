"""Watch the inbox and hand complete, eligible files to the scheduler.

Events are hints, not truth: they only (re)start a file's quiet period in the stability
tracker, and a periodic full rescan — plus one at start and one after any watcher trouble —
catches whatever events missed (inotify drops its overflow silently, network filesystems send
none). On network filesystems, or when the OS refuses more native watches, the inbox is
polled instead, and the log and `doctor` say so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from stemdeck_watch.core.choices import SIDECAR_SUFFIX, move_sidecar, sidecar_of
from stemdeck_watch.core.config import WatchSettings
from stemdeck_watch.core.events import JobChanged
from stemdeck_watch.intake.filters import InboxFilter, readable_name
from stemdeck_watch.links.linkfile import LINK_EXTENSIONS
from stemdeck_watch.intake.stability import StabilityTracker
from stemdeck_watch.intake.symlinks import link_refusal, outside_inbox, set_aside
from stemdeck_watch.core.errors import FilesystemError
from stemdeck_watch.core.paths import (
    MOUNT_TABLE,
    filesystem_type,
    is_network_filesystem,
    move_file,
)
from stemdeck_watch.engine.scheduler import Scheduler
from stemdeck_watch.engine.shares import ShareWatch

log = logging.getLogger(__name__)

TICK_SECONDS = 0.25
MIN_WAIT_SECONDS = 0.005  # a quiet period that just ended: look almost at once
RETRY_SECONDS = 5.0  # after a failure in the loop, the next rescan comes this soon


def choose_mode(
    settings: WatchSettings, inbox: Path, table: str | os.PathLike[str] = MOUNT_TABLE
) -> tuple[str, str]:
    """("native" | "polling", why) for the configured mode and the inbox's filesystem (found
    in the mount table `table`)."""
    if settings.mode != "auto":
        return settings.mode, f"watch.mode = {settings.mode!r}"
    if is_network_filesystem(inbox, table):
        return "polling", (
            f"the inbox is on a network filesystem ({filesystem_type(inbox, table)})"
        )
    return "native", "native filesystem events"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class _Handler(FileSystemEventHandler):
    """Turns watchdog events into calls on the InboxWatcher; never lets an exception escape (a
    handler that raises kills the observer thread)."""

    def __init__(self, intake: InboxWatcher, generation: int = 0):
        self.intake = intake
        self.generation = generation

    def on_any_event(self, event: FileSystemEvent) -> None:
        try:
            self.intake.on_event(event, self.generation)
        except Exception:
            log.exception("handling %s failed; a rescan will follow", event)
            self.intake.request_rescan()


class InboxWatcher:
    def __init__(
        self,
        settings: WatchSettings,
        inbox: Path,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
        links: bool = False,
        mount_table: str | os.PathLike[str] = MOUNT_TABLE,
    ):
        self.settings = settings
        self.inbox = inbox
        self.scheduler = scheduler
        extensions = (*settings.extensions, *(LINK_EXTENSIONS if links else ()))
        self.filter = InboxFilter(extensions, settings.ignore, settings.recursive)
        self.tracker = StabilityTracker(settings.settle_seconds, clock)
        self._clock = clock
        self._observer: BaseObserver | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rescan = threading.Event()
        self._scan_dirs: list[Path] = []
        self._lock = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = None
        self._left: set[Path] = set()  # files not taken, logged once (linked or unreadable folders)
        self._real: dict[Path, str] = {}  # folders with their links resolved, this tick
        # set by the service: whether the inbox's share is there (a watcher that reports
        # every file deleted is not believed while it is away)
        self.shares: ShareWatch | None = None
        self._reobserve = threading.Event()  # the share is back: a fresh observer, a rescan
        # bumped when the share goes away: the observer that saw it go compares against a
        # snapshot of another mount (every inode differs); its events are not believed
        self._generation = 0
        self.mode, self.mode_reason = choose_mode(settings, inbox, mount_table)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._unsubscribe = self.scheduler.bus.subscribe(JobChanged, self._job_changed)
        if self._away():
            self._reobserve.set()  # watched once the share answers (and never made here)
        else:
            self._start_observer()
        self._stop.clear()
        self._rescan.set()  # files already in the inbox are picked up
        self._thread = threading.Thread(target=self._loop, name="intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(5)
            self._observer = None
        if self._thread is not None:
            self._thread.join(5)

    def check_health(self) -> None:
        """Called by the service's supervisor: restart a dead observer or intake loop."""
        if self._stop.is_set():
            return
        if self._away():
            return  # restarted when the share answers
        if self._observer is not None and not self._observer.is_alive():
            log.error("the %s watcher stopped; restarting it and rescanning the inbox", self.mode)
            self._start_observer()
            self.request_rescan()
        if self._thread is not None and not self._thread.is_alive():
            log.error("the intake loop stopped; restarting it")
            self._thread = threading.Thread(target=self._loop, name="intake", daemon=True)
            self._thread.start()

    def request_rescan(self) -> None:
        self._rescan.set()

    def share_changed(self, role: str, away: bool) -> None:
        """The inbox went away: nothing its observer reports is believed any more. It
        answers again: watch it afresh (a polling observer stops for good when its folder
        vanishes) and rescan it, on the intake's own thread."""
        if role != "inbox":
            return
        if away:
            self._generation += 1
        else:
            self._reobserve.set()
            self._rescan.set()

    def _away(self) -> bool:
        """Whether the inbox's share is away, as last seen (no filesystem call)."""
        return self.shares is not None and self.shares.away("inbox")

    def _there(self) -> bool:
        """Whether the inbox answers now, looked at on this thread: a deletion is believed
        only then."""
        return self.shares is None or self.shares.check("inbox")

    def _start_observer(self) -> None:
        self.inbox.mkdir(parents=True, exist_ok=True)
        if self.mode == "native":
            native: BaseObserver | None = None
            try:
                native = Observer()  # inotify: starts its reader thread here already
                native.schedule(
                    _Handler(self, self._generation),
                    str(self.inbox),
                    recursive=self.settings.recursive,
                )
                native.start()
                self._observer = native
                log.info("watching %s with %s", self.inbox, self.mode_reason)
                return
            except OSError as exc:  # ENOSPC / EMFILE: the OS watch limit is reached
                if native is not None:  # or its reader thread and descriptor stay behind
                    native.stop()
                self.mode, self.mode_reason = "polling", f"native watching failed ({exc})"
                log.warning(
                    "could not watch %s natively (%s); polling every %.1f s instead",
                    self.inbox,
                    exc,
                    self.settings.poll_interval,
                )
        observer = PollingObserver(timeout=self.settings.poll_interval)
        observer.schedule(
            _Handler(self, self._generation), str(self.inbox), recursive=self.settings.recursive
        )
        observer.start()
        self._observer = observer
        log.info(
            "polling %s every %.1f s (%s)",
            self.inbox,
            self.settings.poll_interval,
            self.mode_reason,
        )

    # ------------------------------------------------------------ events

    def on_event(self, event: FileSystemEvent, generation: int | None = None) -> None:
        if generation is not None and generation != self._generation:
            return  # from an observer that saw the share go away
        kind = event.event_type
        src = Path(os.fsdecode(event.src_path))
        if kind in ("opened", "closed_no_write"):
            return
        if kind == "deleted" or kind == "moved":
            if not self._there():
                return  # the share is away: its files are not deleted, just out of reach
            self._gone(src)
        renamed = kind == "moved"
        if renamed:
            src = Path(os.fsdecode(event.dest_path))
            if not self._inside(src):
                return
            kind = "created"
        if event.is_directory:
            if kind == "created":  # a folder moved in arrives as one event: look inside
                with self._lock:
                    self._scan_dirs.append(src)
            return
        if kind in ("created", "modified", "closed", "attrib") and self._eligible(src):
            # a file renamed into place inside the inbox (a browser's NAME.part, a sync
            # client's temp file) was finished by its writer, as a closed one was
            self.tracker.touch(src, closed=kind == "closed" or renamed)

    def _job_changed(self, event: JobChanged) -> None:
        """A job ended: if its input is still in the inbox (it changed while the job ran, or
        it could not be moved), look at it again now rather than at the next full rescan —
        the scheduler decides whether it is new content. No filesystem call here: this runs
        on whichever thread changed the job (an API request), and a share may be slow; the
        intake's own thread looks at the file (and forgets it if it is not there)."""
        job = event.job
        if job.state.is_final:
            path = Path(job.source)
            if self._inside(path) and self._eligible(path) and not self._away():
                self.tracker.touch(path)

    def _gone(self, path: Path) -> None:
        self.tracker.forget(path)
        self._left.discard(path)
        if not _utf8(str(path)):
            return  # not UTF-8 text: no job was ever made for it (see _admit)
        self.scheduler.file_gone(path)

    def _inside(self, path: Path) -> bool:
        return path == self.inbox or self.inbox in path.parents

    def _eligible(self, path: Path) -> bool:
        try:
            rel = PurePosixPath(path.relative_to(self.inbox).as_posix())
        except ValueError:
            return False
        return self.filter.eligible(rel)

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        next_rescan = self._clock() + self.settings.rescan_seconds
        retry_at: float | None = None
        while not self._stop.wait(
            TICK_SECONDS if retry_at is not None else self._until_next_look()
        ):
            try:
                if self._away():
                    continue  # nothing to scan or admit until the share answers
                if self._reobserve.is_set():
                    self._reobserve.clear()
                    self._restart_observer()
                if retry_at is not None and self._clock() >= retry_at:
                    retry_at = None
                    self._rescan.set()
                if self._rescan.is_set() or (
                    self.settings.rescan_seconds and self._clock() >= next_rescan
                ):
                    self._rescan.clear()
                    next_rescan = self._clock() + self.settings.rescan_seconds
                    self.scan(self.inbox)
                    self._reconcile()
                with self._lock:
                    folders, self._scan_dirs = self._scan_dirs, []
                for folder in folders:
                    self.scan(folder)
                self.admit_ready()
            except Exception:
                # a file whose job could not be recorded (a failed registry write) is ready no
                # more: a rescan soon offers it again, without hammering a failing disk
                log.exception("the intake loop failed; rescanning in %.0f s", RETRY_SECONDS)
                retry_at = retry_at or self._clock() + RETRY_SECONDS

    def _reconcile(self) -> None:
        """After a full rescan: the inputs of jobs and waiting files that left the inbox
        while nothing could be believed (the share was away and its observer's reports were
        thrown away) or heard (an event lost) are gone for good now, as if seen to go."""
        for source in self.scheduler.sources_in_flight():
            path = Path(source)
            if self._inside(path) and not os.path.lexists(path) and self._there():
                log.info("%s left the inbox while it was not watched", path)
                self._gone(path)

    def _restart_observer(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(5)
        self._start_observer()

    def _until_next_look(self) -> float:
        """A tick, or less when a file's quiet period ends sooner."""
        due = self.tracker.next_due()
        if due is None:
            return TICK_SECONDS
        return min(TICK_SECONDS, max(MIN_WAIT_SECONDS, due - self._clock()))

    def scan(self, folder: Path) -> None:
        """Walk `folder` and start tracking every eligible file in it (a linked folder is
        not walked: links are never followed out of the inbox)."""
        if folder != self.inbox and os.path.islink(folder):
            log.warning(
                "not looking inside %s: it is a symbolic link to %s, and links are not followed",
                folder,
                os.path.realpath(folder),
            )
            return
        for root, dirs, files in os.walk(folder, onerror=lambda e: log.warning("scan: %s", e)):
            root_path = Path(root)
            if not self.settings.recursive and root_path != self.inbox:
                dirs[:] = []
                continue
            dirs[:] = [d for d in dirs if not self.filter.folder_ignored(d)]
            for name in files:
                path = root_path / name
                if self._eligible(path):
                    self.tracker.touch(path)

    def admit_ready(self) -> None:
        """Hand every file that has settled to the scheduler, as one batch (one tick): a
        library dropped at once settles in a few ticks of thousands of files each, so
        what can be done once per tick is (the inbox's links resolved, the waiting lane
        written, the queue announced)."""
        ready = self.tracker.ready()
        if not ready:
            return
        self._real = {}  # folders resolved anew each tick
        with self.scheduler.admitting():
            for path, signature in ready:
                self._admit(path, signature)

    def _admit(self, path: Path, signature) -> None:  # type: ignore[no-untyped-def]
        """Hand a settled file to the scheduler (which decides whether it is wanted, under
        its lock). Only eligible paths are ever tracked (events, scans and ended jobs are
        filtered before `touch`), so the filter is not asked again here."""
        if self._renamed_readable(path):
            return
        rel = PurePosixPath(path.relative_to(self.inbox).as_posix())
        if not _utf8(str(rel)):  # a folder's name is not UTF-8: nothing can record it
            if path not in self._left:
                self._left.add(path)
                log.warning(
                    "not separating %s: the name of its folder is not UTF-8 text; rename "
                    "the folder",
                    ascii(str(path)),
                )
            return
        if self._not_followed(path, rel):
            return
        self.scheduler.submit_file(path, rel, signature)

    def _realpath(self, folder: Path) -> str:
        """`folder` with its links resolved, once per intake tick (a library dropped at once
        lies in a handful of folders)."""
        found = self._real.get(folder)
        if found is None:
            found = self._real[folder] = os.path.realpath(folder)
        return found

    def _renamed_readable(self, path: Path) -> bool:
        """A file whose name is not UTF-8 is renamed in place to a readable name (never
        over another file), its choices (sidecar) with it; the new name is then a file of its
        own. True if renamed (or left, with the reason logged once, where it could not be)."""
        readable = readable_name(path.name, spare=len(SIDECAR_SUFFIX))
        if readable is None:
            return False
        try:
            moved = move_file(path, path.with_name(readable), companion=sidecar_of)
        except FilesystemError as exc:
            if path not in self._left:
                self._left.add(path)
                log.warning("could not give %s a readable name: %s", ascii(path.name), exc)
            return True
        move_sidecar(path, moved)
        log.warning("renamed %s to %s: its name was not UTF-8 text", ascii(path.name), moved.name)
        return True

    def _not_followed(self, path: Path, rel: PurePosixPath) -> bool:
        """A link to a file goes to failed/ with the reason; a file behind a linked folder
        is left where it lives (logged once). True if `path` is either."""
        real_inbox = self._realpath(self.inbox)  # the inbox itself may be a link
        if outside_inbox(path, real_inbox, self._realpath):
            if path not in self._left:
                self._left.add(path)
                log.warning(
                    "not separating %s: it is reached through a symbolic link to a "
                    "folder outside the inbox",
                    path,
                )
            return True
        reason = link_refusal(path, real_inbox)
        if reason is None:
            return False
        try:
            where = set_aside(path, rel, self.scheduler.settings.paths.failed, reason)
        except OSError as exc:
            if path not in self._left:
                self._left.add(path)
                log.error(
                    "could not move the link %s to %s: %s; remove it from the inbox",
                    path,
                    self.scheduler.settings.paths.failed,
                    exc.strerror or exc,
                )
            return True
        self.scheduler.refuse(where, rel, reason)
        return True
