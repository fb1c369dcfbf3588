"""Notifications through apprise: a song is done, a song failed, the queue drained or filled,
jobs came back after a restart, the disk is almost full, a share went away (or came back).

`notify.urls` takes any apprise URL (`json://…`, `mailto://…`, `ntfy://…`, …); `"desktop"` is the
platform's own notifications: D-Bus on Linux (`dbus://` with dbus-python, else `glib://` with
PyGObject), Notification Center on macOS (`macosx://`, needs terminal-notifier), toasts on
Windows (`windows://`, needs pywin32).

Nothing here may slow a job down. The bus listener only turns an event into a small `Note` (no
I/O) and hands it to every target's channel; each target has its own sending thread, so a target
that is down (fails in milliseconds) or hanging (waits for its timeouts) delays neither the
pipeline nor the other targets. A failing target is logged once per failure streak — the first
failure with the reason, then "works again" when it recovers — and is never fatal.

Bursts are coalesced per kind: the first note of a kind goes out at once; more of the same kind
within the next `window` seconds (60) are held and sent as one message that counts them ("12 more
songs are done: …"). `queue_drained` sends whatever is held first, so the summary comes before
"the queue is empty". `queue_drained` itself is only sent after a batch of two or more songs —
for a single song its own done/failed message says everything.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from stemdeck_watch.core.config import NOTIFY_EVENTS, Folders, NotifySettings, Settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import (
    DiskLow,
    Event,
    EventBus,
    JobChanged,
    JobsRestored,
    QueueDrained,
    QueueFull,
    ShareAway,
    ShareBack,
)
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.paths import report_path
from stemdeck_watch.util.safetext import escape_controls, escape_markup
from stemdeck_watch.util.redact import redact_url

log = logging.getLogger(__name__)

APP_ID = "stemdeck-watch"
DESKTOP = "desktop"
WINDOW = 60.0  # seconds: more notes of one kind within this are coalesced
STOP_GRACE = 3.0  # seconds a channel may take to send what is held when stopping
NAMES_SHOWN = 5  # song names listed in a coalesced message
SEEN_LIMIT = 10_000  # job ids remembered to never announce one ending twice
# desktop notification servers (freedesktop) read the body as markup: `<b>`, `<a href>`
MARKUP_SCHEMES = frozenset({"dbus", "kde", "qt", "glib", "gnome"})


@dataclasses.dataclass(frozen=True)
class Note:
    """One notification before it is sent: what happened, in words, and how bad it is."""

    kind: str  # one of NOTIFY_EVENTS
    title: str
    body: str
    level: str = "info"  # info | success | warning | failure (apprise's NotifyType values)
    subject: str = ""  # the song (for coalesced messages)
    detail: str = ""  # the folder or the reason (for coalesced messages)
    folder: str = ""  # outbox or failed folder (for coalesced messages)
    created: float = dataclasses.field(default_factory=time.monotonic)


# ---------------------------------------------------------------- events → notes


def describe_size(size: int) -> str:
    value = float(size)
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} bytes"  # pragma: no cover


class Composer:
    """Turns bus events into notes, on the publisher's thread: cheap, no I/O. Remembers which
    jobs it announced (a job's record may change again after it ended) and counts the batch
    for `queue_drained`."""

    def __init__(self, folders: Folders, events: Iterable[str]):
        self.folders = folders
        self.events = frozenset(events)
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._batch = collections.Counter()

    def notes(self, event: Event) -> list[Note]:
        with self._lock:
            return [n for n in self._notes(event) if n.kind in self.events]

    def _notes(self, event: Event) -> list[Note]:
        if isinstance(event, JobChanged):
            job = event.job
            if job.state not in (JobState.DONE, JobState.FAILED) or job.id in self._seen:
                return []
            self._seen[job.id] = None
            while len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
            self._batch[job.state.value] += 1
            return [
                self.done(job.name, job.output)
                if job.state is JobState.DONE
                else self.failed(job.name, job.error, job.source)
            ]
        if isinstance(event, QueueDrained):
            batch, self._batch = self._batch, collections.Counter()
            if sum(batch.values()) < 2:
                return []
            return [self.drained(batch["done"], batch["failed"])]
        if isinstance(event, QueueFull):
            what = "links" if event.kind == "link" else "songs"
            return [
                Note(
                    "queue_full",
                    "Queue full",
                    f"{event.limit} {what} are queued; new ones wait in the inbox until "
                    f"there is room.",
                    "warning",
                )
            ]
        if isinstance(event, JobsRestored):
            if event.paused:
                body = (
                    f"{event.count} job(s) from before the restart wait for Start (tray "
                    f"menu, queue page or `stemdeck-watch start`)."
                )
            else:
                body = f"{event.count} job(s) from before the restart go on now."
            return [Note("restored", "Jobs restored", body, "info")]
        if isinstance(event, ShareAway):
            return [
                Note(
                    "share_away",
                    f"Share unreachable: {event.role}",
                    f"The {event.role} {event.path} has not answered for "
                    f"{event.seconds:.0f} s ({event.why}). The queue waits for it; no "
                    f"song is lost.",
                    "warning",
                )
            ]
        if isinstance(event, ShareBack):
            return [
                Note(
                    "share_away",
                    f"Share back: {event.role}",
                    f"The {event.role} {event.path} answers again after "
                    f"{event.seconds:.0f} s; the queue goes on.",
                    "success",
                )
            ]
        if isinstance(event, DiskLow):
            return [
                Note(
                    "disk_low",
                    "Disk almost full",
                    f"Only {describe_size(event.free_bytes)} left on the disk of "
                    f"{event.path}; the queue is paused until there is room.",
                    "warning",
                )
            ]
        return []

    def done(self, name: str, output: str | None) -> Note:
        folder = output or str(self.folders.outbox)
        return Note(
            "done",
            f"Stems ready: {name}",
            f"{name} is separated. Stems: {folder}",
            "success",
            subject=name,
            detail=folder,
            folder=str(self.folders.outbox),
        )

    def failed(self, name: str, error: str | None, source: str) -> Note:
        reason = (error or "it failed").rstrip(".")
        failed_dir = self.folders.failed
        where = Path(source)
        if failed_dir == where.parent or failed_dir in where.parents:
            report = f"Report: {report_path(where)}"
        else:
            report = f"The report is in {failed_dir}"
        return Note(
            "failed",
            f"Failed: {name}",
            f"{reason}. {report}",
            "failure",
            subject=name,
            detail=reason,
            folder=str(failed_dir),
        )

    def drained(self, done: int, failed: int) -> Note:
        parts = [f"{done} song{'s' if done != 1 else ''} separated"]
        if failed:
            parts.append(f"{failed} failed (see {self.folders.failed})")
        return Note(
            "queue_drained",
            "Queue finished",
            f"{', '.join(parts)}; nothing is left in the queue.",
            "success" if not failed else "warning" if done else "failure",
        )


def coalesce(kind: str, notes: list[Note], count: int) -> Note:
    """One message for `count` held notes of one kind (`notes` holds the first few)."""
    if count == 1:
        return notes[0]
    names = [n.subject for n in notes[:NAMES_SHOWN] if n.subject]
    more = count - len(names)
    listed = ", ".join(names) + (f" and {more} more" if more > 0 and names else "")
    if kind == "done":
        return Note(
            kind,
            f"Stems ready: {count} more songs",
            f"{count} more songs are separated: {listed}. Stems: {notes[0].folder}",
            "success",
            folder=notes[0].folder,
        )
    if kind == "failed":
        reasons = "; ".join(f"{n.subject}: {n.detail}" for n in notes[:NAMES_SHOWN])
        extra = f"; and {count - min(count, NAMES_SHOWN)} more" if count > NAMES_SHOWN else ""
        return Note(
            kind,
            f"Failed: {count} more songs",
            f"{count} more songs failed — {reasons}{extra}. Reports: {notes[0].folder}",
            "failure",
            folder=notes[0].folder,
        )
    last = notes[-1]
    return dataclasses.replace(last, title=f"{last.title} ({count} times)")


# ---------------------------------------------------------------- targets


class Target:
    """One apprise URL. `send` returns (ok, why not); it blocks for as long as the service
    takes (its own timeouts), which is why every target has a thread of its own.

    A note names songs, and a song's name comes from whoever named the file: its control
    characters are escaped for every target; the body is given to apprise as plain text, which
    it escapes for a target that reads HTML or Markdown (an email, Slack, Telegram), and `&`,
    `<`, `>` are escaped here where a desktop's notification server reads it as markup (a name
    must not turn into a link or hide the rest of the message)."""

    def __init__(self, url: str, label: str | None = None):
        apprise = _load_apprise()

        _quiet_apprise_logger()
        self._apprise = apprise.Apprise(asset=_asset())
        if not self._apprise.add(url):
            raise ValueError(f"apprise cannot use {redact_url(repr(url))}")
        service = self._apprise[0]
        self.markup = url.split("://", 1)[0].lower() in MARKUP_SCHEMES
        self.label = label or service.url(privacy=True).split("?", 1)[0]
        self._text = apprise.NotifyFormat.TEXT
        self._types = {
            "info": apprise.NotifyType.INFO,
            "success": apprise.NotifyType.SUCCESS,
            "warning": apprise.NotifyType.WARNING,
            "failure": apprise.NotifyType.FAILURE,
        }

    def send(self, note: Note) -> tuple[bool, str]:
        title, body = escape_controls(note.title), escape_controls(note.body)
        if self.markup:
            body = escape_markup(body)
        try:
            result = self._apprise.notify(
                body=body,
                title=title,
                notify_type=self._types.get(note.level, "info"),
                body_format=self._text,  # apprise escapes it for an HTML or Markdown target
            )
        except Exception as exc:  # a plugin that raises instead of reporting
            return False, f"{type(exc).__name__}: {exc}"
        if result:
            return True, ""
        try:
            lines = [
                entry.message
                for entry in result.logs()
                if getattr(entry, "level", "")
                in ("WARNING", "ERROR", "CRITICAL", logging.WARNING, logging.ERROR)
            ]
        except Exception:
            lines = []
        return False, lines[-1] if lines else "the service reported a failure"


_loaded = threading.Lock()


def _load_apprise() -> Any:
    """apprise, with its plugins loaded once; some of them import modules that Python marks
    deprecated (PGPy imports `imghdr`): not ours to fix, and not worth a warning."""
    import warnings

    with _loaded:
        import apprise

        if not getattr(_load_apprise, "done", False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                apprise.Apprise().add("json://127.0.0.1/")
            _load_apprise.done = True  # type: ignore[attr-defined]
        return apprise


def _asset() -> Any:
    apprise = _load_apprise()

    # async_mode off and no service timeout: apprise sends on the calling thread (our
    # channel's), starting no thread pool of its own; memory storage: no files in $HOME.
    return apprise.AppriseAsset(
        app_id=APP_ID, app_desc=APP_ID, async_mode=False, service_timeout=0, storage_mode="memory"
    )


_quiet_lock = threading.Lock()


def _quiet_apprise_logger() -> None:
    """apprise logs every failed send; a target that is down would fill the log. Its records
    stop at its own logger; we log one line per failure streak with apprise's reason (taken
    from the result), see Channel."""
    with _quiet_lock:
        logger = logging.getLogger("apprise")
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())  # not Python's last-resort stderr handler
        logger.propagate = False


def desktop_candidates(platform: str = sys.platform) -> list[tuple[str, str]]:
    """(apprise URL, what it needs) for "desktop", best first."""
    if platform == "darwin":
        return [("macosx://", "terminal-notifier (brew install terminal-notifier)")]
    if platform.startswith("win"):
        return [("windows://", "pywin32 (pip install pywin32)")]
    return [
        ("dbus://", "dbus-python (pip install 'stemdeck-watch[dbus]')"),
        ("glib://", "PyGObject (pip install 'stemdeck-watch[tray]')"),
    ]


def session_bus_present(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("DBUS_SESSION_BUS_ADDRESS"):
        return True
    runtime = env.get("XDG_RUNTIME_DIR")
    return bool(runtime) and Path(runtime, "bus").exists()


def resolve_desktop(platform: str = sys.platform) -> tuple[str | None, str]:
    """The apprise URL that reaches this desktop's notifications, or (None, why not)."""
    if platform not in ("darwin",) and not platform.startswith("win") and not session_bus_present():
        return None, "no D-Bus session bus (not in a desktop session)"
    apprise = _load_apprise()

    _quiet_apprise_logger()
    needs = []
    for url, need in desktop_candidates(platform):
        if apprise.Apprise(asset=_asset()).add(url):
            return url, ""
        needs.append(need)
    return None, "install " + " or ".join(needs)


def check_urls(settings: NotifySettings) -> None:
    """Every URL in notify.urls must be one apprise can use; ConfigError naming the key and
    the URL otherwise (`run` exits 2). "desktop" is not checked here: without a desktop it is
    simply off, with a line in the log."""
    urls = [u for u in settings.urls if u != DESKTOP]
    if not urls:
        return
    apprise = _load_apprise()

    _quiet_apprise_logger()
    for url in urls:
        if not apprise.Apprise(asset=_asset()).add(url):
            raise ConfigError(
                f"notify.urls: {redact_url(repr(url))} is not a URL apprise can "
                f"use (unknown service, or a part it needs is missing); see the "
                f"apprise URL list at github.com/caronc/apprise/wiki"
            )


# ---------------------------------------------------------------- one thread per target


class Channel:
    """Sends the notes for one target, in order, coalescing bursts; logs a failing target
    once per streak."""

    def __init__(
        self, target: Any, window: float = WINDOW, clock: Callable[[], float] = time.monotonic
    ):
        self.target = target
        self.window = window
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: collections.deque[Note] = collections.deque()
        self._stopping = False
        self._held: dict[str, tuple[list[Note], int]] = {}
        self._last_sent: dict[str, float] = {}
        self._failing = False
        self._failed_in_streak = 0
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failed = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stemdeck-notify", daemon=True)
        self._thread.start()

    def offer(self, note: Note) -> None:
        with self._cond:
            self._inbox.append(note)
            self._cond.notify()

    def stop(self, timeout: float = STOP_GRACE) -> None:
        """Send what is held (within `timeout`), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "notifications to %s are still being sent after %.0f s; not waiting for them",
                    self.target.label,
                    timeout,
                )
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping:
                    due = self._next_due()
                    timeout = None if due is None else due - self._clock()
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                notes, stopping = list(self._inbox), self._stopping
                self._inbox.clear()
            try:
                for note in notes:
                    self._take(note)
                self._send_due(flush=stopping)
            except Exception:
                log.exception("notification channel for %s failed; going on", self.target.label)
            if stopping:
                return

    def _next_due(self) -> float | None:
        dues = [self._last_sent.get(kind, 0.0) + self.window for kind in self._held]
        return min(dues) if dues else None

    def _take(self, note: Note) -> None:
        kind = note.kind
        if kind == "queue_drained":
            self._send_due(flush=True)  # what the batch held comes first
        now = self._clock()
        if kind in self._held or now - self._last_sent.get(kind, float("-inf")) < self.window:
            first, count = self._held.get(kind, ([], 0))
            if len(first) < NAMES_SHOWN:
                first.append(note)
            self._held[kind] = (first, count + 1)
            return
        self._send(note)

    def _send_due(self, flush: bool = False) -> None:
        now = self._clock()
        for kind in list(self._held):
            if flush or now >= self._last_sent.get(kind, 0.0) + self.window:
                notes, count = self._held.pop(kind)
                self._send(coalesce(kind, notes, count))

    def _send(self, note: Note) -> None:
        self._last_sent[note.kind] = self._clock()
        ok, why = self.target.send(note)
        if ok:
            self.sent += 1
            if self._failing:
                log.info(
                    "notifications to %s work again (%d failed meanwhile)",
                    self.target.label,
                    self._failed_in_streak,
                )
            self._failing, self._failed_in_streak = False, 0
            return
        self.failed += 1
        self._failed_in_streak += 1
        if not self._failing:
            self._failing = True
            log.warning(
                "could not send a notification to %s: %s; further failures of this "
                "target are not logged until it works again",
                self.target.label,
                why,
            )


# ---------------------------------------------------------------- the service's notifier


class Notifier:
    """Listens on the bus and feeds one channel per target; see the module docstring."""

    def __init__(
        self,
        bus: EventBus,
        settings: Settings,
        *,
        window: float = WINDOW,
        targets: list[Any] | None = None,
        platform: str = sys.platform,
    ):
        self.bus = bus
        self.settings = settings.notify
        self.composer = Composer(settings.paths, self.settings.events)
        self.window = window
        self._given = targets
        self._platform = platform
        self.channels: list[Channel] = []
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        targets = self._given if self._given is not None else self._targets()
        self.channels = [Channel(target, self.window) for target in targets]
        if not self.channels:
            return
        for channel in self.channels:
            channel.start()
        self._unsubscribe = self.bus.subscribe(Event, self._on_event)
        log.info(
            "notifications (%s) go to %s",
            ", ".join(self.settings.events) or "none",
            ", ".join(c.target.label for c in self.channels),
        )

    def _targets(self) -> list[Target]:
        targets: list[Target] = []
        if not self.settings.events:
            return targets
        for url in dict.fromkeys(self.settings.urls):
            if url == DESKTOP:
                resolved, why = resolve_desktop(self._platform)
                if resolved is None:
                    log.info("desktop notifications are off: %s", why)
                    continue
                targets.append(Target(resolved, f"desktop ({resolved})"))
            else:
                try:
                    targets.append(Target(url))
                except ValueError as exc:  # check_urls let it through; never fatal here
                    log.error("notify.urls: %s", exc)
        return targets

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for channel in self.channels:
            channel.stop()

    def alive(self) -> bool:
        return all(channel.alive() for channel in self.channels)

    def restart_dead(self) -> None:
        for channel in self.channels:
            if not channel.alive():
                log.error(
                    "the notification thread for %s died; restarting it", channel.target.label
                )
                channel.start()

    def _on_event(self, event: Event) -> None:
        # on the publisher's thread (often the pipeline's): compose and hand over, nothing else
        for note in self.composer.notes(event):
            for channel in self.channels:
                channel.offer(note)


__all__ = [
    "Notifier",
    "Note",
    "Channel",
    "Target",
    "Composer",
    "check_urls",
    "resolve_desktop",
    "NOTIFY_EVENTS",
]
