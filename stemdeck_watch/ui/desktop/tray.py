"""The tray icon (pystray): see the queue at a glance, pause and start, open the folders, quit.

- The icon is drawn with Pillow: slate when idle, blue while a song is being separated, orange
  while the queue is paused, with a red badge while a failure has not been looked at (it clears
  when you open the failed folder or the queue page from the menu).
- Its title (tooltip) names the running song, its progress and the queue length (and a model
  being downloaded, "downloading htdemucs 34 / 80 MB"); it follows the
  event bus, throttled: the bus listener only sets a flag, an updater thread takes one snapshot
  at most every `interval` seconds and changes only what changed.
- The menu: a status line, Pause/Start (one item whose label follows the queue), Open queue
  page (when the API is on), Open inbox, Open outbox, Open failed, Quit. Pause and Start are the
  scheduler's own `pause()`/`start()` — the calls behind the CLI, the API and the page. Quit sets
  the same stop event as Ctrl-C, so the service stops exactly as it does then.
- The tray owns the main thread while it runs (pystray's loop must run there on every
  platform); the supervisor tick runs on a thread beside it and ends the icon's loop when the
  service is asked to stop.

Where a tray can run: on macOS and Windows always; on Linux only with a display and a backend
that has a working menu — `appindicator` or `gtk`, both through PyGObject (pystray's `xorg`
backend shows no menu and gets no clicks, so it is never used). `tray.enabled = "auto"` runs
headless where that is missing and says why (log and `doctor`); `true` makes it an error that
says what to install.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.ui.desktop import opener
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import Event, JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.engine.eta import eta_words
from stemdeck_watch.util.safetext import escape_controls

log = logging.getLogger(__name__)

NAME = "stemdeck-watch"
UPDATE_INTERVAL = 0.5  # seconds between two icon/title/menu updates at most
TITLE_LIMIT = 120  # tooltips are short (Windows cuts at 128 characters)
ICON_SIZE = 64
COLOURS = {  # exact colours: the end-to-end test looks for them on screen
    "idle": (120, 130, 140),
    "separating": (30, 136, 229),
    "paused": (251, 140, 0),
    "error": (211, 47, 47),
}
WHITE = (255, 255, 255, 255)
LINUX_BACKENDS = ("appindicator", "gtk")  # with a menu; pystray's xorg backend has none
INSTALL_GTK = (
    "on Debian/Ubuntu: `sudo apt install gir1.2-gtk-3.0 libgirepository1.0-dev "
    "libcairo2-dev pkg-config`, then `pip install 'stemdeck-watch[tray]'` "
    "(PyGObject); or run with `--no-tray`"
)
PAUSE_WORDS = {
    "user": "by you",
    "restore": "restored jobs wait for Start",
    "folder": "PAUSE file in the inbox",
    "disk": "disk almost full",
    "inbox": "inbox share unreachable",
    "outbox": "outbox share unreachable",
}


# ---------------------------------------------------------------- where a tray can run


@dataclasses.dataclass(frozen=True)
class TrayChoice:
    backend: str | None  # pystray backend to use, or None: headless
    reason: str  # why headless (or which backend and why)


PROBE = r"""
import json, sys
out = {"gi": False, "gtk": False, "appindicator": False, "error": ""}
try:
    import gi
    out["gi"] = True
    gi.require_version("Gtk", "3.0")
    from gi.repository import Gtk
    out["gtk"] = bool(Gtk.init_check()[0])
    if not out["gtk"]:
        out["error"] = "GTK could not open the display"
    for name in ("AyatanaAppIndicator3", "AppIndicator3"):
        try:
            gi.require_version(name, "0.1")
            out["appindicator"] = True
            break
        except ValueError:
            pass
except (ImportError, ValueError) as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""


def probe_gtk(env: dict[str, str], timeout: float = 20.0) -> dict[str, Any]:
    """Ask a child interpreter whether PyGObject, GTK 3 (on this display) and an
    AppIndicator library are there: a broken GTK must not take the service down with it."""
    child_env = dict(env, NO_AT_BRIDGE="1")
    try:
        result = subprocess.run(
            [sys.executable, "-c", PROBE],
            env=child_env,
            timeout=timeout,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {
            "gi": False,
            "gtk": False,
            "appindicator": False,
            "error": f"the GTK probe failed: {exc}",
        }


def detect(
    enabled: bool | str,
    *,
    no_tray: bool = False,
    env: dict[str, str] | None = None,
    platform: str = sys.platform,
    probe: Callable[[dict[str, str]], dict[str, Any]] = probe_gtk,
) -> TrayChoice:
    """Which pystray backend to run here, or why none."""
    env = dict(os.environ if env is None else env)
    if no_tray:
        return TrayChoice(None, "run --no-tray")
    if enabled is False:
        return TrayChoice(None, "tray.enabled = false")
    if platform == "darwin":
        return TrayChoice("darwin", "macOS")
    if platform.startswith("win"):
        return TrayChoice("win32", "Windows")
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        return TrayChoice(None, "no display (neither DISPLAY nor WAYLAND_DISPLAY is set)")
    forced = env.get("PYSTRAY_BACKEND", "")
    if forced and forced not in LINUX_BACKENDS:
        return TrayChoice(
            None,
            f"PYSTRAY_BACKEND={forced} has no working menu; use gtk or appindicator, or unset it",
        )
    found = probe(env)
    if not found.get("gi"):
        return TrayChoice(None, f"PyGObject is not installed ({INSTALL_GTK})")
    if not found.get("gtk"):
        return TrayChoice(
            None, f"GTK 3 is not usable here: {found.get('error') or 'unknown'} ({INSTALL_GTK})"
        )
    if forced == "appindicator" and not found.get("appindicator"):
        return TrayChoice(
            None,
            "PYSTRAY_BACKEND=appindicator, but no AppIndicator library "
            "is installed (`sudo apt install gir1.2-ayatanaappindicator3-0.1`)",
        )
    backend = forced or ("appindicator" if found.get("appindicator") else "gtk")
    return TrayChoice(
        backend, f"{backend} backend on {env.get('DISPLAY') or env.get('WAYLAND_DISPLAY')}"
    )


def choose(enabled: bool | str, *, no_tray: bool = False, **kwargs: Any) -> TrayChoice:
    """`detect`, with `tray.enabled = true` turning a missing tray into a ConfigError (exit 2)."""
    choice = detect(enabled, no_tray=no_tray, **kwargs)
    if choice.backend is None and enabled is True and not no_tray:
        raise ConfigError(
            f"tray.enabled = true, but no tray icon can be shown: {choice.reason}"
            f' — or set tray.enabled = "auto" to run without one where it '
            f"cannot be shown"
        )
    return choice


# ---------------------------------------------------------------- the picture


def draw_icon(state: str, error: bool = False, size: int = ICON_SIZE) -> Any:
    """The tray picture: a rounded square in the state's colour with a white glyph (three
    stems; stems at different levels while separating; a pause sign), and a red badge while a
    failure has not been looked at."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    unit = size / 16
    draw.rounded_rectangle(
        (0, 0, size - 1, size - 1), radius=int(3 * unit), fill=COLOURS[state] + (255,)
    )
    if state == "paused":
        for x in (5, 9):
            draw.rectangle((x * unit, 4 * unit, (x + 2) * unit - 1, 12 * unit - 1), fill=WHITE)
    else:
        lengths = (8, 8, 8) if state == "idle" else (9, 5, 7)
        for row, length in enumerate(lengths):
            y = (4 + 3 * row) * unit
            draw.rectangle((3 * unit, y, (3 + length) * unit - 1, y + unit - 1), fill=WHITE)
    if error:
        r = 3.5 * unit
        cx, cy = size - r - 1, r + 1
        draw.ellipse(
            (cx - r, cy - r, cx + r, cy + r),
            fill=COLOURS["error"] + (255,),
            outline=WHITE,
            width=max(1, int(unit / 2)),
        )
        draw.rectangle(
            (cx - unit / 2, cy - 2 * unit, cx + unit / 2 - 1, cy + 0.5 * unit), fill=WHITE
        )
        draw.rectangle(
            (cx - unit / 2, cy + 1.2 * unit, cx + unit / 2 - 1, cy + 2 * unit), fill=WHITE
        )
    return image


# ---------------------------------------------------------------- what the tray shows


@dataclasses.dataclass(frozen=True)
class View:
    state: str  # idle | separating | paused
    error: bool  # a failure not looked at yet
    paused: bool
    title: str
    status: str  # the menu's first line

    @property
    def shown_state(self) -> str:
        """idle / separating / paused / error — the one word for the icon's state."""
        return "error" if self.error else self.state


def build_view(snap: dict[str, Any], failure: tuple[str, str] | None) -> View:
    """What the icon shows. Song names come from whoever named the files: their control
    characters are escaped, so none adds a line to the tooltip or reorders it."""
    running, queued = snap.get("running"), len(snap.get("queued", []))
    waiting = len(snap.get("waiting", []))
    paused = bool(snap.get("paused"))
    queue_words = f"{queued} queued" if queued else "nothing queued"
    if waiting:
        queue_words += f", {waiting} waiting"
    if running:
        pct = f"{running.get('progress', 0.0) * 100:.0f}%"
        doing = f"{escape_controls(running['name'])} — {running['state']} {pct}"
        others = [j for j in snap.get("active", []) if j["id"] != running["id"]]
        if others:  # publishing behind it
            also = ", ".join(f"{escape_controls(j['name'])} {j['state']}" for j in others)
            doing += f" (+ {also})"
    else:
        doing = ""
    if paused:
        state = "paused"
        why = PAUSE_WORDS.get(snap.get("pause_reason") or "", snap.get("pause_reason") or "")
        status = f"Paused ({why})" if why else "Paused"
        if doing:
            status += f"; finishing {doing}"
    elif running:
        state, status = "separating", doing
    else:
        state, status = "idle", "Idle"
    download = snap.get("download")
    if download:  # the first use of a model: say why nothing moves yet
        status = f"{escape_controls(download['text'])} · {status}"
    status += f" · {queue_words}"
    title = f"{NAME}: {status}"
    done = eta_words(snap.get("eta"))
    if done:
        title += f" · {done}"
    if failure:
        title += f" · failed: {escape_controls(failure[0])}"
    if len(title) > TITLE_LIMIT:
        title = title[: TITLE_LIMIT - 1] + "…"
    return View(state, failure is not None, paused, title, status)


def load_pystray(backend: str | None = None) -> Any:
    """Import pystray with `backend`. Without one (the tests' icon, which implements the
    backend hooks itself) it is imported for its Menu and MenuItem only: pystray picks a
    backend at import and fails without a display, so the import then names the inert
    `dummy` module, which is never run."""
    if "pystray" in sys.modules:
        return sys.modules["pystray"]
    previous = os.environ.get("PYSTRAY_BACKEND")
    os.environ["PYSTRAY_BACKEND"] = backend or previous or "dummy"
    try:
        return importlib.import_module("pystray")
    finally:
        if backend is None:
            if previous is None:
                os.environ.pop("PYSTRAY_BACKEND", None)
            else:
                os.environ["PYSTRAY_BACKEND"] = previous


class Tray:
    """The icon, its menu and its updater; talks only to the scheduler and the event bus."""

    def __init__(
        self,
        service: Any,
        stop: threading.Event,
        *,
        open_target: Callable[[str], None] = opener.open_target,
        interval: float = UPDATE_INTERVAL,
    ):
        self.service = service
        self.scheduler = service.scheduler
        self.folders = service.folders
        self.stop_event = stop
        self._open = open_target
        self.interval = interval
        self.icon: Any = None
        self.view: View | None = None
        self._failure: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()  # the updater and a menu action, one at a time
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._last_update = float("-inf")
        self.updates = 0

    # ------------------------------------------------------------ the icon and its menu

    def create_icon(self, icon_class: type | None = None, backend: str | None = None) -> Any:
        """The pystray icon: `icon_class` (a subclass of pystray's Icon implementing the
        backend hooks), or the platform's icon for `backend`."""
        pystray = load_pystray(backend if icon_class is None else None)
        if icon_class is None:
            icon_class = _signal_keeping(pystray.Icon)
        self.view = self._build_view()
        self.icon = icon_class(
            NAME,
            icon=draw_icon(self.view.state, self.view.error),
            title=self.view.title,
            menu=self.menu(pystray),
        )
        return self.icon

    def menu(self, pystray: Any) -> Any:
        Menu, Item = pystray.Menu, pystray.MenuItem
        api_on = self.service.api is not None
        return Menu(
            Item(lambda _item: self.view.status if self.view else NAME, None, enabled=False),
            Menu.SEPARATOR,
            Item(
                lambda _item: "Start" if self.scheduler.queue.paused else "Pause", self.toggle_pause
            ),
            Menu.SEPARATOR,
            Item("Open queue page", self.open_page, visible=api_on),
            Item("Open inbox", lambda: self.open_folder("inbox")),
            Item("Open outbox", lambda: self.open_folder("outbox")),
            Item("Open failed", lambda: self.open_folder("failed")),
            Menu.SEPARATOR,
            Item("Quit", self.quit),
        )

    # ------------------------------------------------------------ the menu's actions

    def toggle_pause(self) -> None:
        if self.scheduler.queue.paused:
            log.info("Start from the tray")
            self.scheduler.start()
        else:
            log.info("Pause from the tray")
            self.scheduler.pause()
        self.refresh()

    def open_page(self) -> None:
        api = self.service.api
        if api is None:
            log.warning("the queue page is off (the local API is not running)")
            return
        self._seen()
        self._open_logged(api.page_url(), "the queue page")

    def open_folder(self, which: str) -> None:
        folder: Path = getattr(self.folders, which)
        if which == "failed":
            self._seen()
        folder.mkdir(parents=True, exist_ok=True)
        self._open_logged(str(folder), f"the {which} folder")

    def quit(self) -> None:
        """The same as Ctrl-C: the stop event; the service shuts down cleanly, then the icon
        goes."""
        log.info("Quit from the tray: stopping")
        self.stop_event.set()

    def _open_logged(self, target: str, what: str) -> None:
        try:
            self._open(target)
        except OSError as exc:
            log.warning("could not open %s: %s", what, exc)

    def _seen(self) -> None:
        with self._lock:
            had, self._failure = self._failure, None
        if had:
            self.refresh()

    # ------------------------------------------------------------ following the service

    def start(self) -> None:
        self._unsubscribe = self.scheduler.bus.subscribe(Event, self._on_event)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="stemdeck-tray", daemon=True)
        self._thread.start()
        self._dirty.set()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stopping.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _on_event(self, event: Event) -> None:
        # the publisher's thread: remember a failure, set a flag, nothing else
        if isinstance(event, JobChanged) and event.job.state is JobState.FAILED:
            with self._lock:
                self._failure = (event.job.name, event.job.error or "")
        self._dirty.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._dirty.wait()
            if self._stopping.is_set():
                break
            delay = self._last_update + self.interval - time.monotonic()
            if delay > 0 and self._stopping.wait(delay):
                break
            self._dirty.clear()
            try:
                self.refresh()
            except Exception:
                log.exception("could not update the tray icon; going on")

    def _build_view(self) -> View:
        with self._lock:
            failure = self._failure
        return build_view(self.scheduler.snapshot(), failure)

    def refresh(self) -> None:
        """Show the service's state now: picture, title and menu, each only if it changed."""
        with self._refreshing:
            self._last_update = time.monotonic()
            view = self._build_view()
            old, self.view = self.view, view
            icon = self.icon
            if icon is None:
                return
            if old is None or (old.state, old.error) != (view.state, view.error):
                icon.icon = draw_icon(view.state, view.error)
            if old is None or old.title != view.title:
                icon.title = view.title
            if old is None or (old.status, old.paused) != (view.status, view.paused):
                icon.update_menu()
            self.updates += 1


def _signal_keeping(base: type) -> type:
    """pystray's GTK backends reset SIGINT to the default (kill the process) when their loop
    starts; put the service's handlers back, so that Ctrl-C still stops cleanly."""
    handlers = {sig: signal.getsignal(sig) for sig in _stop_signals()}

    class StemdeckIcon(base):  # type: ignore[misc, valid-type]
        def _mark_ready(self) -> None:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    if callable(handler):
                        signal.signal(sig, handler)
                self._set_tooltip()
            super()._mark_ready()

        def _update_title(self) -> None:
            super()._update_title()
            if getattr(self, "_status_icon", None) is not None:
                from gi.repository import GLib

                GLib.idle_add(self._set_tooltip)  # GTK only from its own thread

        def _set_tooltip(self) -> bool:
            """pystray's gtk backend sets the StatusIcon's title, which no tray shows on
            hover; the tooltip is what a person sees."""
            status_icon = getattr(self, "_status_icon", None)
            if status_icon is not None:
                status_icon.set_tooltip_text(self.title)
            return False  # once (as a GLib idle callback)

    return StemdeckIcon


def _stop_signals() -> list[int]:
    sigs = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGBREAK"):
        sigs.append(signal.SIGBREAK)  # type: ignore[attr-defined]
    return sigs


# ---------------------------------------------------------------- run with the tray


def run_with_tray(
    service: Any,
    stop: threading.Event,
    backend: str | None,
    *,
    icon_class: type | None = None,
    tray_factory: Callable[..., Tray] = Tray,
) -> None:
    """Start the service, show the icon on this (the main) thread until `stop` is set, then
    shut down. If the icon cannot be shown, the service runs on without it."""
    service.start(stop)
    if not service.started:
        return  # stopped while standing by for another computer's service: nothing to show
    tray: Tray | None = None
    supervisor: threading.Thread | None = None
    try:
        try:
            tray = tray_factory(service, stop)
            icon = tray.create_icon(icon_class, backend)
        except Exception as exc:
            log.error(
                "could not show the tray icon (%s: %s); running without it", type(exc).__name__, exc
            )
            tray = None
            service.supervise_until(stop)
            return
        tray.start()

        def supervise() -> None:
            service.supervise_until(stop)
            icon.stop()  # ends the icon's loop on the main thread

        supervisor = threading.Thread(target=supervise, name="stemdeck-supervisor", daemon=True)
        supervisor.start()
        log.info("tray icon shown (%s)", backend or type(icon).__name__)
        try:
            icon.run()
        except Exception:
            if stop.is_set():  # e.g. pystray's GTK cleanup without a notification service
                log.debug("the tray icon's loop ended with an error while stopping", exc_info=True)
            else:
                log.exception("the tray icon failed; running without it")
        if not stop.is_set():
            log.warning("the tray icon went away; the service runs on (Ctrl-C stops it)")
            while not stop.wait(0.5):
                pass
    finally:
        stop.set()
        if supervisor is not None:
            supervisor.join()
        if tray is not None:
            tray.stop()
        service.shutdown()
