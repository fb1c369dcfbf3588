"""Folders on a share that comes and goes: a NAS, an sshfs or SMB mount, a sync folder.

A share that drops for a minute must pause the queue, not empty it. Seen from the service, a
share that is away looks like one of: the folder is missing (the mount below it is gone), it
answers EIO/ENOTCONN/ESTALE/EHOSTDOWN or cannot be read, or it is suddenly an empty local
folder — the mount point without its mount (it now sits on its parent's device, or the
`.stemdeck/` folder the service keeps in the inbox is gone). Every one of them means "the share
is away", never "every file was deleted": a watcher that reports every file deleted is not
believed while the inbox is away.

`ShareWatch` looks at the inbox, outbox, processed/ and failed/ every second on its own thread
(a share that is only slow stalls this thread, never the API or `status`). While the inbox or
the outbox is away the queue is paused with `pause_reason = "inbox"` (or "outbox"): every job
keeps its place, the running song finishes into scratch, and a song whose stems cannot be
published waits in scratch. When the share answers again the inbox is rescanned, inputs whose
move into processed/ or failed/ could not be done are moved (they were kept in the registry),
and the queue goes on — unless someone paused it meanwhile: a pause the user chose stays.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.choices import ANY, move_sidecar, sidecar_of
from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import SHUTDOWN, Cancelled, FilesystemError
from stemdeck_watch.core.events import ShareAway, ShareBack
from stemdeck_watch.core.jobs import FileSignature
from stemdeck_watch.core.paths import (
    GONE_ERRNOS,
    exists_or_unreachable,
    find_moved,
    is_unreachable,
    move_file,
    report_path,
)
from stemdeck_watch.engine.scheduler import PAUSE_INBOX, PAUSE_OUTBOX, PAUSE_USER, Scheduler
from stemdeck_watch.stages.manifest import recorded_sidecar
from stemdeck_watch.stages.publish import remove_tree
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.store.registry import REGISTRY_FILE, PendingMove, Registry
from stemdeck_watch.util.ticker import Ticker

log = logging.getLogger(__name__)

PROBE_SECONDS = 1.0  # how often each folder is looked at
GRACE_SECONDS = 60.0  # a share away this long is announced (notification)
MOVES_SECONDS = 30.0  # pending moves are tried this often besides "the share is back"
MARKER = ".stemdeck"  # kept in the inbox by the service (intake/ownership.py)
MOUNTS_META = "share_mounts"  # registry meta: where each folder's filesystem was mounted
ROLES = ("inbox", "outbox", "processed", "failed")
PAUSES = {"inbox": PAUSE_INBOX, "outbox": PAUSE_OUTBOX}  # the folders the queue waits for


def _why(folder: Path, exc: OSError) -> str:
    if exc.errno in GONE_ERRNOS:
        return f"{folder} is missing"
    return f"{folder} cannot be reached: {exc.strerror or exc}"


class FolderProbe:
    """Whether one folder answers, and whether it still is the folder it was: the mount that
    held it when it was first seen (this run or the last: `mount` is kept in the registry)
    is still mounted, and the marker folder (inbox only) seen then is still there. Every
    call is a few stats; on a slow share, a slow call."""

    def __init__(self, folder: Path, marker: str | None = None):
        self.folder = folder
        self.marker = marker
        self.mount: Path | None = None  # the top of the filesystem holding the folder
        self._marker_seen = False

    def problem(self) -> str | None:
        """None while the folder answers; else why it is away, in words."""
        folder = self.folder
        try:
            if self.mount is not None and not is_mounted(self.mount):
                return (
                    f"the share mounted at {self.mount} is not mounted (what is there is "
                    f"a local folder)"
                )
            info = os.stat(folder)
        except OSError as exc:
            return _why(folder, exc)
        if not stat.S_ISDIR(info.st_mode):
            return f"{folder} is not a folder"
        if not os.access(folder, os.R_OK | os.X_OK):
            return f"{folder} cannot be read (permission denied)"
        try:
            if self.mount is None:
                self.mount = _filesystem_top(folder, info.st_dev)
            if self.marker is not None:
                try:
                    os.lstat(folder / self.marker)
                    self._marker_seen = True
                except OSError as exc:
                    if exc.errno not in GONE_ERRNOS:
                        return _why(folder, exc)
                    if self._marker_seen:
                        return (
                            f"{folder / self.marker} is gone: the share is not mounted "
                            f"there (if you removed that folder, restart the service)"
                        )
        except OSError as exc:
            return _why(folder, exc)
        return None


def unmounted_at_start(state_dir: Path, folders: dict[str, Path]) -> dict[str, Path]:
    """role → mount point, for each folder (by role) whose filesystem was a mount when the
    service last ran and is not mounted now; read from the registry without changing it."""
    try:
        registry = Registry.open_readonly(state_dir / REGISTRY_FILE)
    except sqlite3.Error:
        return {}
    if registry is None:
        return {}
    try:
        recorded = _load(registry.get_meta(MOUNTS_META))
    except sqlite3.Error:
        recorded = {}
    finally:
        registry.close()
    away = {}
    for role, folder in folders.items():
        known = recorded.get(role) or {}
        if known.get("path") != str(folder) or not known.get("mount"):
            continue
        mount = Path(known["mount"])
        try:
            mounted = is_mounted(mount)
        except OSError:
            mounted = False
        if not mounted:
            away[role] = mount
    return away


def _load(text: str | None) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def is_mounted(top: Path) -> bool:
    """Whether the filesystem whose top folder is `top` is mounted there: `top` sits on
    another device than its parent (the root is always mounted). A mount point without its
    mount is a plain folder on its parent's device, or missing."""
    if top.parent == top:
        return True
    return os.stat(top).st_dev != os.stat(top.parent).st_dev


def _filesystem_top(folder: Path, device: int) -> Path:
    """The highest folder above `folder` on the same device: its mount point."""
    top = folder
    while top.parent != top:
        try:
            if os.stat(top.parent).st_dev != device:
                break
        except OSError:
            break
        top = top.parent
    return top


class ShareWatch(Ticker):
    """Knows which of the service's folders are away; pauses and resumes the queue for the
    inbox and the outbox; keeps and retries the moves that could not reach their file."""

    name = "share-watch"

    def __init__(
        self,
        scheduler: Scheduler,
        settings: Settings,
        *,
        interval: float = PROBE_SECONDS,
        grace: float = GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(interval)
        self.scheduler = scheduler
        folders = settings.paths
        self.folders = {
            "inbox": folders.inbox,
            "outbox": folders.outbox,
            "processed": folders.processed,
            "failed": folders.failed,
        }
        self.probes = {
            role: FolderProbe(folder, MARKER if role == "inbox" else None)
            for role, folder in self.folders.items()
        }
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._away: dict[str, tuple[float, str]] = {}  # role → (since, why)
        self._announced: set[str] = set()
        self._prior: str | None = None  # the pause reason the share's pause stands in for
        self._moves_due = True  # at start-up, and whenever a folder answers again
        self._moves_at = float("-inf")
        self._listeners: list[Callable[[str, bool], None]] = []
        self._recorded = _load(scheduler.registry.get_meta(MOUNTS_META))
        for role, probe in self.probes.items():
            known = self._recorded.get(role)
            if known and known.get("path") == str(probe.folder) and known.get("mount"):
                probe.mount = Path(known["mount"])
        self._closing = threading.Event()  # the service is stopping: nobody waits for a share
        # staging folders of jobs that ended while the outbox was away: removed once it answers
        self._leftovers: set[Path] = set()
        self._leftovers_lock = threading.Lock()

    # ------------------------------------------------------------ what others ask

    def away(self, role: str = "inbox") -> bool:
        """Whether `role` was away when last looked at (no filesystem call: for any thread)."""
        return role in self._away

    def away_now(self) -> dict[str, str]:
        """role → why, for every folder away (no filesystem call)."""
        return {role: why for role, (_since, why) in dict(self._away).items()}

    def check(self, role: str) -> bool:
        """Look at `role` now (on the caller's thread) and act on what is found; True if
        it answers."""
        problem = self.probes[role].problem()
        self._update(role, problem)
        return problem is None

    def look(self, role: str) -> bool:
        """Look at `role` and note what is found without acting on it: at start-up, before
        the restore has read how the last run left the queue (a pause the user chose must
        not be replaced). The next `tick` pauses for it."""
        problem = self.probes[role].problem()
        with self._lock:
            if problem is not None and role not in self._away:
                self._away[role] = (self._clock(), problem)
                log.warning("the %s is away: %s", role, problem)
        return problem is None

    def wait_back(self, role: str, control: JobControl) -> None:
        """Block until `role` answers again; a cancel, or the service stopping (also for a
        song whose stems were already going out), raises Cancelled meanwhile."""
        while not self.check(role):
            if self._closing.is_set():
                raise Cancelled(SHUTDOWN)
            control.wait(self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        self._closing.set()
        super().stop(timeout)

    def start(self) -> None:
        self._closing.clear()
        super().start()

    def subscribe(self, listener: Callable[[str, bool], None]) -> None:
        """Call `listener(role, away)` whenever a folder goes away or answers again."""
        self._listeners.append(listener)

    def defer_move(
        self,
        job_id: str,
        kind: str,
        source: Path,
        target: Path,
        signature: FileSignature | None,
        why: str,
    ) -> None:
        """Keep a move of a finished job's input (into processed/ or failed/) that could not
        reach the file: done when the share answers again, and at start-up."""
        self.scheduler.registry.add_pending_move(
            PendingMove(job_id, kind, str(source), str(target), signature, time.time())
        )
        log.warning(
            "%s cannot be moved to %s/ now (%s); it is moved when the share answers",
            source,
            kind,
            why,
        )
        self._moves_due = True

    def remove_when_back(self, folder: Path) -> None:
        """`folder` (a job's staging folder, in the outbox) is no longer wanted, but the
        outbox was away when it was removed: it is removed when the outbox answers (a share
        that comes back brings back what the job had half-written)."""
        with self._leftovers_lock:
            self._leftovers.add(folder)

    def keep(self, folder: Path) -> None:
        """`folder` is written again (the same job's next attempt): not a leftover. Waits
        for a removal under way, so the attempt starts on a folder nobody removes."""
        with self._leftovers_lock:
            self._leftovers.discard(folder)

    def _remove_leftovers(self) -> None:
        with self._leftovers_lock:
            for folder in sorted(self._leftovers):
                remove_tree(folder)
            self._leftovers.clear()

    # ------------------------------------------------------------ the thread

    def tick(self) -> None:
        for role in ROLES:
            self.check(role)
        self._record_mounts()
        with self._lock:
            self._hold()  # someone started the queue while a folder it needs is away
            due = [
                (role, since, why)
                for role, (since, why) in self._away.items()
                if role not in self._announced and self._clock() - since >= self.grace
            ]
            self._announced.update(role for role, _since, _why in due)
        for role, since, why in due:
            self.scheduler.bus.publish(
                ShareAway(role, str(self.folders[role]), why, self._clock() - since)
            )
        now = self._clock()
        if self._moves_due or now >= self._moves_at:
            self._moves_due = False
            self._moves_at = now + MOVES_SECONDS
            self.retry_moves()

    def _record_mounts(self) -> None:
        """Keep where each folder's filesystem is mounted, for the next start: a service
        started while the NAS is not mounted yet must know that its inbox is away, not empty
        (and must not create it on the local disk)."""
        mounts = {
            role: {"path": str(probe.folder), "mount": str(probe.mount)}
            for role, probe in self.probes.items()
            if probe.mount is not None
        }
        if mounts != self._recorded:
            self.scheduler.registry.set_meta(MOUNTS_META, json.dumps(mounts))
            self._recorded = mounts

    def _update(self, role: str, problem: str | None) -> None:
        back: float | None = None
        announced = False
        went = False
        with self._lock:
            was = self._away.get(role)
            if problem is not None and was is None:
                went = True
                self._away[role] = (self._clock(), problem)
                log.warning(
                    "the %s is away: %s; %s",
                    role,
                    problem,
                    "the queue is paused until it answers"
                    if role in PAUSES
                    else "inputs are moved there when it answers",
                )
                self._hold()
            elif problem is None and was is not None:
                del self._away[role]
                back = self._clock() - was[0]
                announced = role in self._announced
                self._announced.discard(role)
                log.info(
                    "the %s %s answers again after %.0f s away", role, self.folders[role], back
                )
                self._moves_due = True
                if role == "inbox":
                    self.scheduler.learn_inbox_filesystem()
                self._release()
        if not went and back is None:
            return
        if role == "outbox" and not went:
            self._remove_leftovers()
        if announced:
            self.scheduler.bus.publish(ShareBack(role, str(self.folders[role]), back or 0.0))
        for listener in list(self._listeners):
            try:
                listener(role, went)
            except Exception:
                log.exception(
                    "acting on the %s %s failed", role, "going away" if went else "coming back"
                )

    def _hold(self) -> None:
        """Pause for the folder the queue waits for (the inbox before the outbox), unless
        the user paused it: theirs stays. Another reason (a restore, the PAUSE file, the
        disk) is remembered and comes back with the share."""
        reason = next((PAUSES[role] for role in PAUSES if role in self._away), None)
        if reason is None:
            return
        queue = self.scheduler.queue
        current = queue.pause_reason if queue.paused else None
        if current == reason or current == PAUSE_USER:
            return
        if current not in PAUSES.values():
            self._prior = current
        self.scheduler.pause(reason)

    def _release(self) -> None:
        if any(role in self._away for role in PAUSES):
            self._hold()  # the inbox is back, the outbox is not (or the reverse)
            return
        queue = self.scheduler.queue
        prior, self._prior = self._prior, None
        if not (queue.paused and queue.pause_reason in PAUSES.values()):
            return  # started or paused by someone else meanwhile: theirs stays
        if prior:
            self.scheduler.pause(prior)
        else:
            self.scheduler.start()

    # ------------------------------------------------------------ pending moves

    def retry_moves(self) -> int:
        """Do the moves kept while their share was away; returns how many are done. A move
        whose job is not on record as finished yet waits for the next round."""
        done = 0
        for move in self.scheduler.registry.pending_moves():
            if self.away("inbox") or self.away(move.kind):
                break
            job = self.scheduler.registry.get(move.job_id)
            if job is not None and not job.state.is_final:
                self._moves_due = True
                continue
            try:
                if self._finish_move(move):
                    done += 1
            except OSError as exc:  # still cannot be reached: kept for the next round
                log.debug("%s cannot be reached yet: %s", move.source, exc)
        return done

    def _finish_move(self, move: PendingMove) -> bool:
        """One pending move; False while the input still cannot be reached. A move that can
        never be done (the input is gone or changed) is dropped with a line in the log."""
        registry = self.scheduler.registry
        source, target = Path(move.source), Path(move.target)
        found = exists_or_unreachable(source)  # raises while it cannot be reached
        sig = move.signature
        where: Path | None = None
        if found is None:
            where = find_moved(target, sig.size, sig.mtime_ns) if sig else None
            log.info(
                "%s is no longer in the inbox%s", source, f"; it is at {where}" if where else ""
            )
        elif sig is not None and FileSignature.of(found) != sig:
            log.warning(
                "%s changed while its share was away: it stays in the inbox as a new song", source
            )
        else:
            try:
                where = move_file(
                    source, target, companion=sidecar_of, within=self.folders[move.kind]
                )
            except FilesystemError as exc:
                if is_unreachable(exc) or not self.check(move.kind):
                    return False
                registry.remove_pending_move(move.job_id)
                log.error("%s; the input stays in the inbox", exc)
                if move.kind == "processed" and registry.get(move.job_id) is not None:
                    self.scheduler.update(
                        move.job_id,
                        error=f"stems published, but {exc}; the input stays in the inbox",
                    )
                return True
            job = registry.get(move.job_id)
            used = (  # into processed/: only the sidecar the song was separated with
                recorded_sidecar(Path(job.output) if job and job.output else None, move.job_id)
                if move.kind == "processed"
                else ANY
            )
            left = move_sidecar(source, where, used)
            if left and job is not None:
                self.scheduler.update(move.job_id, error="; ".join(filter(None, (job.error, left))))
            if move.kind == "failed":
                _place_report(target, where)
        registry.remove_pending_move(move.job_id)
        if where is not None and registry.get(move.job_id) is not None:
            self.scheduler.update(move.job_id, source=str(where))
        if where is not None:
            log.info("moved %s to %s (kept until its share answered)", source, where)
        return True


def _place_report(target: Path, where: Path) -> None:
    """A failed input's report was written beside its target while the input could not be
    moved: if the input went to a numbered name, the report follows it."""
    written = report_path(target)
    wanted = report_path(where)
    if written != wanted and os.path.lexists(written) and not os.path.lexists(wanted):
        try:
            os.rename(written, wanted)
        except OSError as exc:
            log.warning("could not rename %s to %s: %s", written, wanted, exc)
