"""The tray without a display: the real pystray Menu and MenuItems, driven on a small Icon
subclass that implements pystray's backend hooks and records what it was asked to show (never
pystray's `dummy` backend, whose run() raises and leaves a thread behind). Against a live
service: labels and the icon follow it, Pause/Start really pause and start its queue, the
folders and the page open, Quit stops it cleanly. Also: where a tray can run, and why not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.ui.web import discovery
from stemdeck_watch.ui.desktop.tray import (
    COLOURS,
    Tray,
    build_view,
    choose,
    detect,
    draw_icon,
    load_pystray,
    run_with_tray,
)
from stemdeck_watch.cli.doctor import check_tray
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import QueueDrained
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for, write_config

base = load_pystray()._base


class RecordingIcon(base.Icon):
    """pystray's Icon with the backend hooks implemented: records updates; `run` returns when
    `stop` is called (like a real loop would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self._ended = threading.Event()

    def _show(self):
        self.calls.append("show")

    def _hide(self):
        self.calls.append("hide")

    def _update_icon(self):
        self.calls.append("icon")
        self._icon_valid = True

    def _update_title(self):
        self.calls.append("title")

    def _update_menu(self):
        self.calls.append("menu")

    def _run(self):
        self._mark_ready()
        self._ended.wait()

    def _run_detached(self):
        self._mark_ready()

    def _stop(self):
        self._ended.set()

    # what a person sees
    def labels(self) -> list[str]:
        return [item.text for item in self.menu if item is not base.Menu.SEPARATOR]

    def item(self, text: str):
        return next(item for item in self.menu if item.text == text)

    def colour(self) -> tuple[int, int, int]:
        return self.icon.getpixel((self.icon.width // 2, self.icon.height - 4))[:3]

    def badge(self) -> bool:
        return self.icon.getpixel((self.icon.width - 8, 8))[:3] in (
            COLOURS["error"],
            (255, 255, 255),
        )


@pytest.mark.slow
def test_menu_and_icon_follow_the_live_service(make_settings, service_factory, tmp_path):
    settings = make_settings(notify={"urls": []})
    service, jobs = service_factory(settings)
    opened: list[str] = []
    stop = threading.Event()
    tray = Tray(service, stop, open_target=opened.append, interval=0.05)
    icon = tray.create_icon(RecordingIcon)
    icon.visible = True
    tray.start()
    try:
        assert icon.labels() == [
            "Idle · nothing queued",
            "Pause",
            "Open queue page",
            "Open inbox",
            "Open outbox",
            "Open failed",
            "Quit",
        ]
        assert icon.colour() == COLOURS["idle"] and icon.title.startswith("stemdeck-watch: Idle")
        assert not icon.item(icon.labels()[0]).enabled  # the status line is not an action

        # Pause is the scheduler's own pause: the live queue is paused, by the user
        icon.item("Pause")(icon)
        assert service.scheduler.queue.paused and service.scheduler.queue.pause_reason == "user"
        wait_for(lambda: icon.colour() == COLOURS["paused"], 5, "the paused icon")
        assert "Start" in icon.labels() and "Pause" not in icon.labels()
        assert icon.labels()[0] == "Paused (by you) · nothing queued"
        assert "Paused (by you)" in icon.title

        # a song dropped while paused waits; Start starts it, and the tray shows it running
        shutil.copy(write_song(tmp_path / "Tray Song.flac", 4.0), settings.paths.inbox)
        wait_for(lambda: "1 queued" in icon.title, 10, "the queued song in the title")
        icon.item("Start")(icon)
        assert not service.scheduler.queue.paused
        wait_for(lambda: icon.colour() == COLOURS["separating"], 60, "the separating icon")
        wait_for(
            lambda: "Tray Song — " in icon.title and "%" in icon.title,
            10,
            "the running song and its progress in the title",
        )
        assert icon.labels()[1] == "Pause"
        jobs.wait_final(1)
        wait_for(lambda: icon.colour() == COLOURS["idle"], 10, "idle again")

        # a failure puts a badge on the icon until the failed folder is opened
        (settings.paths.inbox / "broken.wav").write_bytes(os.urandom(5000))
        jobs.wait_final(2)
        wait_for(lambda: icon.badge(), 10, "the failure badge")
        assert "failed: broken" in icon.title
        icon.item("Open failed")(icon)
        assert opened[-1] == str(settings.paths.failed)
        wait_for(lambda: not icon.badge(), 5, "the badge to clear once the failure was seen")
        icon.item("Open inbox")(icon)
        icon.item("Open outbox")(icon)
        icon.item("Open queue page")(icon)
        assert opened[-3:-1] == [str(settings.paths.inbox), str(settings.paths.outbox)]
        assert opened[-1].startswith(f"{service.api.url}#code=")
        assert service.api.token not in opened[-1]
        assert {"icon", "title", "menu"} <= set(icon.calls)
    finally:
        tray.stop()
    assert not stop.is_set()


@pytest.mark.slow
def test_updates_are_throttled(make_settings, service_factory):
    service, _ = service_factory(make_settings(notify={"urls": []}))
    tray = Tray(service, threading.Event(), open_target=lambda _t: None, interval=0.5)
    icon = tray.create_icon(RecordingIcon)
    tray.start()
    try:
        wait_for(lambda: tray.updates >= 1, 5, "the first update")
        before = tray.updates
        for _ in range(200):  # any event wakes the updater
            service.bus.publish(QueueDrained())
        wait_for(lambda: tray.updates > before, 5, "the update after the burst")
        assert tray.updates - before <= 2, "200 events within 0.5 s make at most two updates"
    finally:
        tray.stop()
    assert icon.title


@pytest.mark.slow
def test_quit_stops_the_service_exactly_like_ctrl_c(make_settings):
    """run_with_tray as `run` uses it (here on a worker thread, with the recording icon):
    Quit sets the stop event, the supervisor ends the icon's loop, the service shuts down and
    withdraws its discovery file; the state dir can be used again at once."""
    settings = make_settings(notify={"urls": []})
    service = Service(settings)
    stop = threading.Event()
    made: list[Tray] = []

    def factory(svc, ev):
        tray = Tray(svc, ev, open_target=lambda _t: None)
        made.append(tray)
        return tray

    runner = threading.Thread(
        target=run_with_tray,
        args=(service, stop, None),
        kwargs={"icon_class": RecordingIcon, "tray_factory": factory},
    )
    runner.start()
    try:
        wait_for(
            lambda: made and made[0].icon is not None and made[0].icon.visible,
            30,
            "the icon to be shown",
        )
        assert discovery.read(settings.paths.state) is not None
        icon = made[0].icon
        icon.item("Quit")(icon)
        runner.join(30)
        assert not runner.is_alive()
    finally:
        stop.set()
        runner.join(30)
    assert discovery.read(settings.paths.state) is None  # withdrawn at the clean stop
    again = Service(settings)  # the lock was released
    again.start()
    again.shutdown()


def test_the_view_says_what_the_service_does():
    snap = {
        "paused": False,
        "pause_reason": None,
        "queued": [{}, {}],
        "waiting": [{}],
        "running": {"name": "Song", "state": "separating", "progress": 0.421},
    }
    view = build_view(snap, None)
    assert (view.state, view.shown_state) == ("separating", "separating")
    assert view.title == "stemdeck-watch: Song — separating 42% · 2 queued, 1 waiting"
    view = build_view(dict(snap, paused=True, pause_reason="restore"), ("Bad", "not audio"))
    assert view.shown_state == "error" and view.state == "paused"
    assert view.status.startswith("Paused (restored jobs wait for Start); finishing Song")
    view = build_view(
        dict(snap, running=None, paused=True, pause_reason="user"), ("Bad", "not audio")
    )
    assert view.title == "stemdeck-watch: Paused (by you) · 2 queued, 1 waiting · failed: Bad"
    long = build_view(dict(snap, running=dict(snap["running"], name="x" * 300)), None)
    assert len(long.title) == 120 and long.title.endswith("…")
    for state in ("idle", "separating", "paused"):
        image = draw_icon(state, error=True)
        assert image.size == (64, 64) and image.getpixel((32, 60))[:3] == COLOURS[state]
        assert image.getpixel((57, 6))[:3] in (COLOURS["error"], (255, 255, 255))


def test_a_hostile_song_name_reaches_the_tray_escaped():
    """The tray's title (its tooltip) and status line name the running song and the last
    failure: a name's newline would add a line of its own there, a direction override would
    make it read as something else. They show escaped, as in status and the log."""
    name = "evil\nstemdeck-watch: Idle\u202egnp.exe"
    snap = {
        "paused": False,
        "pause_reason": None,
        "queued": [],
        "waiting": [],
        "running": {"name": name, "state": "separating", "progress": 0.5},
    }
    view = build_view(snap, (name, "not audio"))
    for text in (view.title, view.status):
        assert "\n" not in text and "\u202e" not in text, text
        assert "evil\\nstemdeck-watch: Idle\\u202egnp.exe" in text, text


def test_where_a_tray_can_run():
    no_probe = lambda _env: pytest.fail("no probe without a display")  # noqa: E731
    choice = detect("auto", env={}, platform="linux", probe=no_probe)
    assert choice.backend is None and "no display" in choice.reason
    assert detect("auto", no_tray=True, env={"DISPLAY": ":0"}, probe=no_probe).backend is None
    assert detect(False, env={"DISPLAY": ":0"}, probe=no_probe).backend is None
    xorg = detect("auto", env={"DISPLAY": ":0", "PYSTRAY_BACKEND": "xorg"}, probe=no_probe)
    assert xorg.backend is None and "no working menu" in xorg.reason
    no_gi = detect("auto", env={"DISPLAY": ":0"}, probe=lambda _e: {"gi": False})
    assert no_gi.backend is None and "PyGObject is not installed" in no_gi.reason
    assert "gir1.2-gtk-3.0" in no_gi.reason and "stemdeck-watch[tray]" in no_gi.reason
    bad = detect(
        "auto",
        env={"DISPLAY": ":9"},
        probe=lambda _e: {"gi": True, "gtk": False, "error": "GTK could not open the display"},
    )
    assert bad.backend is None and "could not open the display" in bad.reason
    ok = {"gi": True, "gtk": True, "appindicator": False}
    assert detect("auto", env={"DISPLAY": ":0"}, probe=lambda _e: ok).backend == "gtk"
    assert (
        detect(True, env={"DISPLAY": ":0"}, probe=lambda _e: dict(ok, appindicator=True)).backend
        == "appindicator"
    )
    assert (
        detect(
            "auto",
            env={"DISPLAY": ":0", "PYSTRAY_BACKEND": "gtk"},
            probe=lambda _e: dict(ok, appindicator=True),
        ).backend
        == "gtk"
    )
    assert detect("auto", env={}, platform="darwin", probe=no_probe).backend == "darwin"
    assert detect("auto", env={}, platform="win32", probe=no_probe).backend == "win32"
    with pytest.raises(
        ConfigError, match="tray.enabled = true, but no tray icon can be shown: no display"
    ):
        choose(True, env={}, platform="linux", probe=no_probe)
    assert choose(True, no_tray=True, env={}, probe=no_probe).backend is None


def test_doctor_says_why_there_is_no_tray(monkeypatch, tmp_path):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if sys.platform != "linux":
        pytest.skip("the display rule is Linux's")
    auto = check_tray(settings_from_dict({}))
    assert auto.ok and auto.warning and "goes headless: no display" in auto.detail
    forced = check_tray(settings_from_dict({"tray": {"enabled": True}}))
    assert not forced.ok and "tray.enabled = true" in forced.detail
    assert check_tray(settings_from_dict({"tray": {"enabled": False}})).detail.startswith("off")


def test_run_with_tray_enabled_and_no_display_exits_2(tmp_path, model_repo):
    config = write_config(tmp_path, model_repo, tray={"enabled": True}, notify={"urls": []})
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert "tray.enabled = true, but no tray icon can be shown: no display" in result.stderr
    assert not (tmp_path / "state" / "registry.sqlite3").exists()


def test_opening_folders_and_pages_per_platform(tmp_path, monkeypatch, caplog):
    from stemdeck_watch.ui.desktop import opener

    assert opener.opener_command("linux") == ["xdg-open"]
    assert opener.opener_command("darwin") == ["open"]
    assert opener.opener_command("win32") is None  # os.startfile
    monkeypatch.setenv("PATH", str(tmp_path))  # no xdg-open here
    with pytest.raises(OSError, match="xdg-open is not installed"):
        opener.open_target(tmp_path, platform="linux")
    # an opener that fails is logged, and reaped (the leak check sees no child left)
    fake = tmp_path / "xdg-open"
    fake.write_text("#!/bin/sh\necho 'no handler for' \"$1\" >&2\nexit 3\n")
    fake.chmod(0o755)
    opener.open_target(tmp_path / "inbox", platform="linux")
    wait_for(lambda: "could not open" in caplog.text, 10, "the opener's failure in the log")
    assert "exited with 3 (no handler for" in caplog.text
