"""Control from the synced folder, for a person away from the computer.

A phone reaches the service only through the sync client, so the folder itself is the remote
control: while a file named `PAUSE` (any case, any extension) sits at the top of the inbox the
queue is paused with reason "folder", and `outbox/STATUS.txt` says what the service is doing.
STATUS.txt is rewritten atomically (a sync client never uploads half of it) and at most every
few seconds (each rewrite is an upload).

Like every control surface this talks only to the scheduler and the event bus.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.core.events import Event
from stemdeck_watch.intake.filters import is_pause_file
from stemdeck_watch.util.safefile import is_temp_name, write_replacing
from stemdeck_watch.util.safetext import strip_controls
from stemdeck_watch.engine.scheduler import PAUSE_FOLDER, PAUSE_RESTORE, Scheduler

log = logging.getLogger(__name__)

STATUS_FILE = "STATUS.txt"
STATUS_EVERY = 3.0  # seconds between rewrites of STATUS.txt at most
PAUSE_CHECK_EVERY = 1.0
# the inbox is listed again only when its own mtime changed (a file was added, removed or
# renamed at the top) or this long after the last listing (coarse mtimes, odd filesystems):
# a library of 10,000 songs waiting in the inbox must not be listed every second
PAUSE_FULL_CHECK_EVERY = 30.0
RECENT_FAILURES = 5
QUEUE_LINES = 30
REASONS = {
    "user": "paused by you",
    "restore": "jobs restored after a restart wait for Start",
    "folder": "paused by the PAUSE file in the inbox — delete it to start",
    "disk": "paused: the disk is almost full",
    "inbox": "paused: the inbox's share cannot be reached — it starts again when the "
    "share answers; no song is lost",
    "outbox": "paused: the outbox's share cannot be reached — separated songs wait and "
    "are published when it answers",
}


class FolderRemote:
    def __init__(
        self,
        scheduler: Scheduler,
        inbox: Path,
        outbox: Path,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.scheduler = scheduler
        self.inbox = inbox
        self.status_path = outbox / STATUS_FILE
        self._clock = clock
        self._stop = threading.Event()
        self._dirty = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._last_written = float("-inf")
        self._status_took = 0.0  # seconds the last STATUS.txt took to render
        self._listed_stamp: int | None = None  # the inbox's mtime when last listed
        self._list_again_at = float("-inf")
        self._pause_path: Path | None = None
        self._unreadable: str | None = None  # why the inbox could not be listed (logged once)
        self._status_failing = False  # STATUS.txt could not be written (logged once)
        # set by the service: whether the inbox's or the outbox's share is away; nothing is
        # looked for or written there meanwhile (a mount point left behind is a local folder)
        self.away: Callable[[str], bool] = lambda _role: False

    def start(self) -> None:
        if self._unsubscribe is not None:  # a restart after the thread died
            self._unsubscribe()
        self._unsubscribe = self.scheduler.bus.subscribe(Event, lambda _e: self._dirty.set())
        self._stop.clear()
        self._dirty.set()
        self._thread = threading.Thread(target=self._loop, name="folder-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if not self.away("outbox"):
            self.write_status()  # the last word: "service stopped"

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        next_check = self._clock()
        while not self._stop.is_set():
            try:
                now = self._clock()
                if now >= next_check and not self.away("inbox"):
                    self.check_pause_file()
                    next_check = now + PAUSE_CHECK_EVERY
                if (
                    self._dirty.is_set()
                    # a long queue's status takes a while to write: never most of the time
                    and now - self._last_written >= max(STATUS_EVERY, 9 * self._status_took)
                    and not self.away("outbox")
                ):
                    self._dirty.clear()
                    self.write_status()
            except Exception:
                log.exception("folder control failed; going on")
            self._stop.wait(0.25)

    def check_pause_file(self) -> None:
        """Pause while a PAUSE file exists; start again when it is gone. A pause the user
        chose elsewhere is theirs: the file neither overrides nor lifts it."""
        present = self.pause_file() is not None
        queue = self.scheduler.queue
        if present and (not queue.paused or queue.pause_reason == PAUSE_RESTORE):
            log.info("a PAUSE file is in %s: pausing the queue", self.inbox)
            self.scheduler.pause(PAUSE_FOLDER)
        elif not present and queue.paused and queue.pause_reason == PAUSE_FOLDER:
            log.info("the PAUSE file is gone: starting the queue")
            self.scheduler.start()

    def pause_file(self) -> Path | None:
        """The PAUSE file at the top of the inbox, if there is one. One stat of the inbox
        per call; the listing only when the inbox's top level changed (see
        PAUSE_FULL_CHECK_EVERY)."""
        now = self._clock()
        try:
            stamp: int | None = os.stat(self.inbox).st_mtime_ns  # before listing: a change
        except OSError:  # meanwhile lists again
            stamp = None
        if stamp is not None and stamp == self._listed_stamp and now < self._list_again_at:
            return self._pause_path
        found = None
        try:
            with os.scandir(self.inbox) as entries:
                for entry in entries:
                    if is_pause_file(entry.name) and entry.is_file():
                        found = Path(entry.path)
                        break
        except OSError as exc:
            # the inbox's share is away: what was there is still there (a PAUSE file does
            # not vanish because the share did), said once, not every second
            if self._unreadable is None:
                log.warning(
                    "could not look for a PAUSE file in %s: %s; looking again every %.0f s",
                    self.inbox,
                    exc.strerror or exc,
                    PAUSE_CHECK_EVERY,
                )
            self._unreadable = str(exc.strerror or exc)
            self._listed_stamp = None
            return self._pause_path
        if self._unreadable is not None:
            log.info("the inbox %s can be listed again", self.inbox)
            self._unreadable = None
        self._listed_stamp, self._list_again_at = stamp, now + PAUSE_FULL_CHECK_EVERY
        self._pause_path = found
        return found

    # ------------------------------------------------------------ STATUS.txt

    def write_status(self) -> None:
        self._last_written = self._clock()
        began = time.monotonic()
        text = render_status_text(self.scheduler.snapshot(), running=not self._stop.is_set())
        self._status_took = time.monotonic() - began
        try:  # a failed rewrite leaves the last status whole and no temporary file
            write_replacing(self.status_path, text)
        except OSError as exc:
            if not self._status_failing:  # the outbox's share is away: once, not every time
                log.warning("could not write %s: %s", self.status_path, exc)
            self._status_failing = True
        else:
            self._status_failing = False


def is_status_temp(name: str) -> bool:
    """Whether `name` is STATUS.txt's temporary copy while it is rewritten (hidden, random)."""
    return is_temp_name(name, STATUS_FILE)


def render_status_text(status: dict[str, Any], running: bool = True) -> str:
    """What a phone shows: plain text, most important first."""
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    lines = [f"stemdeck-watch — {now}"]
    if not running:
        lines.append("The service is stopped.")
    elif status["paused"]:
        reason = status["pause_reason"]
        lines.append(f"Queue: {REASONS.get(reason, f'paused ({reason})')}.")
    else:
        lines.append("Queue: running.")
    job = status["running"]
    lines.append("")
    # names and messages come from other people: a control character in one (a newline that
    # would add a line of its own, an escape sequence) is shown as `?`
    doing = [job] + [j for j in status.get("active", []) if j["id"] != job["id"]] if job else []
    lines += [
        f"{'Now:' if i == 0 else '    '} {strip_controls(j['name'])} — {j['state']} "
        f"{j['progress'] * 100:.0f}%"
        for i, j in enumerate(doing)
    ] or ["Now: nothing is being separated."]
    queued = status["queued"]
    lines += ["", f"Queued ({len(queued)}):"]
    lines += [f"  {i}. {strip_controls(j['name'])}" for i, j in enumerate(queued[:QUEUE_LINES], 1)]
    if len(queued) > QUEUE_LINES:
        lines.append(f"  … and {len(queued) - QUEUE_LINES} more")
    if status["waiting"]:
        lines += ["", f"Waiting for room in the queue ({len(status['waiting'])}):"]
        lines += [
            f"  {strip_controls(Path(w['source']).name)}" for w in status["waiting"][:QUEUE_LINES]
        ]
    failures = [j for j in status["jobs"] if j["state"] == "failed"][:RECENT_FAILURES]
    if failures:
        lines += ["", "Recent failures:"]
        lines += [f"  {strip_controls(j['name'])}: {strip_controls(j['error'])}" for j in failures]
    lines += [
        "",
        "Pause from here: put a file named PAUSE at the top of the inbox; delete it "
        "to start again.",
    ]
    return "\n".join(lines) + "\n"
