"""The tray and desktop notifications for real (see desktop.py for what they need).

Tray: Xvfb, the trayer tray host, and `stemdeck-watch run` as a subprocess (pystray's loop owns
its main thread) with the gtk backend under `dbus-run-session`; xdotool right-clicks the icon
and clicks menu items, ImageMagick screenshots show what is on screen. The icon must appear
(its idle colour on screen), the menu must open, clicking Pause must pause the live service's
queue (its API says so, the icon turns orange), Start must start it again, and Quit must stop the
service cleanly (exit 0, discovery file withdrawn).

Desktop notifications: a stand-in org.freedesktop.Notifications service on a private session
bus receives what the service's notifier sends for `"desktop"` (and through `glib://`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import desktop
from support.helpers import wait_for, write_config
from stemdeck_watch.ui.web import discovery
from stemdeck_watch.ui.web.client import Client
from stemdeck_watch.ui.desktop.tray import COLOURS

TRAY_HEIGHT = 32
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def highlighted(rgb) -> bool:
    """A selected menu item's background (GTK's blue), not white, grey or the icon colours."""
    r, g, b = rgb
    return b > 170 and b - r > 100 and 100 < g < 190 and rgb != COLOURS["separating"]


def menu_shown(image) -> bool:
    return (
        desktop.bbox(image, lambda rgb: rgb == (255, 255, 255), (0, TRAY_HEIGHT, 320, 320))
        is not None
    )


class Screen:
    def __init__(self, display: str):
        self.display = display

    def shot(self):
        return desktop.screenshot(self.display)

    def icon(self, colour) -> tuple[int, int] | None:
        box = desktop.bbox(self.shot(), desktop.near(colour), (0, 0, 200, TRAY_HEIGHT + 4))
        return None if box is None else ((box[0] + box[2]) // 2, (box[1] + box[3]) // 2)

    def choose(self, icon_at: tuple[int, int], key: str) -> None:
        """Right-click the icon, wait for the menu, select an item with `key` (Down: the first
        item that can be clicked, Up: the last), and click it where the menu shows it."""
        desktop.xdotool(self.display, "mousemove", str(icon_at[0]), str(icon_at[1]), "click", "3")
        wait_for(lambda: menu_shown(self.shot()), 10, "the menu to open")
        desktop.xdotool(self.display, "key", key)
        box = wait_for(
            lambda: desktop.bbox(self.shot(), highlighted, (0, TRAY_HEIGHT, 320, 320)),
            10,
            "the selected menu item",
        )
        x, y = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
        desktop.xdotool(self.display, "mousemove", str(x), str(y), "click", "1")
        wait_for(lambda: not menu_shown(self.shot()), 10, "the menu to close")


@pytest.mark.slow
def test_real_tray_icon_menu_pause_start_and_quit(tmp_path, model_repo):
    desktop.require_tray()
    config = write_config(tmp_path, model_repo, notify={"urls": []}, tray={"enabled": True})
    state = tmp_path / "state"
    home = tmp_path / "home"
    home.mkdir()
    with desktop.xvfb() as display:
        env = dict(
            os.environ, DISPLAY=display, HOME=str(home), NO_AT_BRIDGE="1", PYSTRAY_BACKEND="gtk"
        )
        env.pop("DBUS_SESSION_BUS_ADDRESS", None)
        trayer = [
            "trayer",
            "--edge",
            "top",
            "--align",
            "left",
            "--widthtype",
            "pixel",
            "--width",
            "120",
            "--heighttype",
            "pixel",
            "--height",
            str(TRAY_HEIGHT),
            "--SetDockType",
            "true",
            "--transparent",
            "false",
            "--tint",
            "0x000000",
        ]
        run = [
            "dbus-run-session",
            "--",
            sys.executable,
            "-m",
            "stemdeck_watch",
            "--config",
            str(config),
            "run",
        ]
        with (
            desktop.started(trayer, env, tmp_path / "trayer.log"),
            desktop.started(run, env, tmp_path / "run.log") as service,
        ):
            try:
                client = wait_for(lambda: _connect(state), 60, "the service's API")
                screen = Screen(display)
                at = wait_for(lambda: screen.icon(COLOURS["idle"]), 30, "the idle icon on screen")

                screen.choose(at, "Down")  # the first item: Pause
                wait_for(lambda: client.get("/api/queue")["paused"], 10, "the queue to pause")
                assert client.get("/api/queue")["pause_reason"] == "user"
                wait_for(lambda: screen.icon(COLOURS["paused"]), 10, "the paused icon")

                screen.choose(at, "Down")  # the same item, now Start
                wait_for(lambda: not client.get("/api/queue")["paused"], 10, "the queue to start")
                wait_for(lambda: screen.icon(COLOURS["idle"]), 10, "the idle icon again")

                screen.choose(at, "Up")  # the last item: Quit
                assert service.wait(30) == 0
            finally:
                _interrupt(service)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert "tray icon shown (gtk)" in log, log
    assert "Pause from the tray" in log and "Start from the tray" in log
    assert "Quit from the tray: stopping" in log and log.rstrip().endswith("stopped"), log
    assert discovery.read(state) is None  # withdrawn: a clean stop


def _connect(state: Path) -> Client | None:
    try:
        client = Client.connect(state)
        client.get("/api/queue")
        return client
    except Exception:
        return None


def _interrupt(service: subprocess.Popen) -> None:
    """If the service still runs (a failed test), Ctrl-C it the way a person would: the
    signal goes to stemdeck-watch, not to dbus-run-session around it."""
    if service.poll() is None:
        for child in desktop.children(service.pid):
            os.kill(child, signal.SIGINT)
        deadline = time.monotonic() + 30
        while service.poll() is None and time.monotonic() < deadline:
            try:
                service.wait(0.5)
            except subprocess.TimeoutExpired:
                pass


@pytest.mark.slow
def test_desktop_notifications_reach_the_session_bus(tmp_path):
    desktop.require_desktop_notifications()
    env = {k: v for k, v in os.environ.items() if k != "DBUS_SESSION_BUS_ADDRESS"}
    result = subprocess.run(
        [
            "dbus-run-session",
            "--",
            sys.executable,
            str(SUPPORT / "notify_desktop_check.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["labels"] == ["desktop (dbus://)"]
    first, second = got["received"]
    assert first == {
        "app": "stemdeck-watch",
        "summary": "Stems ready: Desk Song",
        "body": f"Desk Song is separated. Stems: {tmp_path / 'outbox' / 'Desk Song'}",
    }
    assert got["glib_sent"] is True and second["summary"] == "Through glib"
