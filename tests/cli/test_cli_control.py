"""`pause`, `start`, `cancel`, `move`, `retry`, `open` as a user types them, against a real
service (started in this process, so the test can see its queue) through its real local API."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.cli.main import main
from stemdeck_watch.core.config import load_settings
from stemdeck_watch.ui.web import discovery
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for, write_config


@pytest.fixture
def config(tmp_path: Path, model_repo: Path) -> Path:
    return write_config(tmp_path, model_repo)


class Cli:
    def __init__(self, config: Path, capsys: pytest.CaptureFixture[str]):
        self.config, self.capsys = config, capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main([*args, "--config", str(self.config)])
        out, err = self.capsys.readouterr()
        return code, out, err

    def ok(self, *args: str) -> str:
        code, out, err = self(*args)
        assert code == 0, (args, out, err)
        return out


def drop(inbox: Path, tmp_path: Path, name: str, seconds: float, seed: int = 0) -> Path:
    staged = write_song(tmp_path / "staging" / name, seconds, seed=seed)
    os.replace(staged, inbox / name)
    return inbox / name


def queue(service: Any) -> dict[str, Any]:
    return service.scheduler.snapshot()


def queued_names(service: Any) -> list[str]:
    return [j["name"] for j in queue(service)["queued"]]


def jobs_named(service: Any, name: str) -> list[dict[str, Any]]:
    return [j for j in queue(service)["jobs"] if j["name"] == name]


def trade(service: Any, link: str) -> tuple[int, str | None]:
    """What the queue page does with a one-time link: trade its code for the token."""
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=10)
    try:
        code = link.split("#code=", 1)[1]
        conn.request(
            "POST",
            "/api/token",
            body=json.dumps({"code": code}),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read()).get("token")
    finally:
        conn.close()


COMMANDS = (
    ["pause"],
    ["start"],
    ["cancel", "x"],
    ["move", "x", "--first"],
    ["retry", "x"],
    ["open"],
)


def test_control_commands_say_in_one_line_that_no_service_runs(config, capsys, tmp_path):
    cli = Cli(config, capsys)
    state = tmp_path / "state"
    for args in COMMANDS:
        code, out, err = cli(*args)
        assert code == 1 and out == "", args
        assert err == (
            f"stemdeck-watch: the service is not running (state folder {state}); "
            f"start it with `stemdeck-watch run`\n"
        )
    # left behind by a service that was killed: its pid is gone, so is the service
    discovery.publish(state, "127.0.0.1", 9, 2**22 + 12345, "stale-token")
    code, _, err = cli("pause")
    assert code == 1 and "the service is not running" in err
    assert cli.ok("status").startswith("service: stopped")


def test_control_usage_errors_exit_2(config, capsys):
    for args in (
        ["move", "x"],
        ["move", "x", "--first", "--after", "y"],
        ["cancel"],
        ["retry"],
        ["move", "--first"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--config", str(config)])
        assert exit_info.value.code == 2, args
    capsys.readouterr()


def test_control_commands_never_import_the_heavy_modules(config):
    code = (
        "import sys; from stemdeck_watch.cli.main import main; "
        f"rc = main(['--config', {str(config)!r}, 'pause']); "
        "heavy = [m for m in ('torch', 'demucs', 'av', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "the service is not running" in result.stderr


@pytest.mark.slow
def test_cli_steers_a_running_service(config, capsys, service_factory, tmp_path, monkeypatch):
    settings = load_settings(config)
    service, _ = service_factory(settings)
    cli = Cli(config, capsys)
    inbox = settings.paths.inbox

    out = cli.ok("pause")
    assert out.startswith("paused") and "stemdeck-watch start" in out
    assert queue(service)["pause_reason"] == "user"
    # one at a time, as a user drops them: files landing within the same instant have no
    # order of their own to keep
    for i, name in enumerate(("a", "b", "c")):
        drop(inbox, tmp_path, f"{name}.wav", 1.0, seed=i)
        want = ["a", "b", "c"][: i + 1]
        wait_for(
            lambda want=want: queued_names(service) == want,
            30,
            lambda want=want: (
                f"{want} queued in order (queued: {queued_names(service)}, "
                f"waiting: {queue(service)['waiting']})"
            ),
        )

    out = cli.ok("move", "c", "--first")
    assert out.splitlines()[0] == "moved c first"
    assert queued_names(service) == ["c", "a", "b"]
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["c", "a", "b"]
    b_id = jobs_named(service, "b")[0]["id"]
    cli.ok("move", b_id[:6], "--after", "c")  # an id prefix works as well as a name
    assert queued_names(service) == ["c", "b", "a"]

    out = cli.ok("cancel", "a")
    a_id = jobs_named(service, "a")[0]["id"]
    assert out == f"cancelled a (job {a_id})\n"
    assert jobs_named(service, "a")[0]["state"] == "cancelled"
    assert (inbox / "a.wav").is_file()  # the file stays where it is
    out = cli.ok("move", "b", "--after", "a")  # a has left the queue: b goes to the end
    assert "a is not queued any more, so b went to the end" in out
    assert queued_names(service) == ["c", "b"]

    out = cli.ok("retry", "a")
    new_a = next(j for j in jobs_named(service, "a") if j["state"] == "queued")
    assert out == f"queued a again as job {new_a['id']}\n"
    assert queued_names(service) == ["c", "b", "a"]

    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", lambda url, *a, **k: opened.append(url) or True)
    out = cli.ok("open")
    port, token = service.api.port, service.api.token
    assert len(opened) == 1 and out == opened[0] + "\n" and token not in out
    assert opened[0].startswith(f"http://127.0.0.1:{port}/#code=")
    assert trade(service, opened[0]) == (200, token)  # the page's one trade

    out = cli.ok("start")
    assert out.startswith("started")
    wait_for(
        lambda: [j["state"] for j in queue(service)["jobs"]].count("done") == 3,
        120,
        "c, b and a separated",
    )

    c_id = jobs_named(service, "c")[0]["id"]
    for args, message in (
        # a short ref is a name only: it never picks the job whose id starts so
        (("remove", c_id[:3]), "at least 6 characters of its id"),
        (("cancel", "c"), "already done"),
        (("retry", "c"), "only failed or cancelled jobs can be retried"),
        (("cancel", "nosuch"), "no job 'nosuch'"),
        (("move", "c", "--first"), "only queued jobs can be moved"),
        (("retry", "a"), "'a' matches several jobs"),
    ):
        code, out, err = cli(*args)
        assert code == 1 and out == "" and message in err, (args, err)
        assert err.startswith("stemdeck-watch: ") and err.count("\n") == 1


@pytest.mark.slow
def test_a_cli_cancel_survives_a_rescan_and_a_restart_but_not_a_changed_file(
    config, capsys, service_factory, tmp_path
):
    settings = load_settings(config)
    service, _ = service_factory(settings)
    cli = Cli(config, capsys)
    cli.ok("pause")
    song = drop(settings.paths.inbox, tmp_path, "song.wav", 1.0)
    wait_for(lambda: queued_names(service) == ["song"], 30, "the song queued")
    cli.ok("cancel", "song")
    service.intake.request_rescan()
    drop(settings.paths.inbox, tmp_path, "marker.wav", 1.0, seed=1)
    wait_for(lambda: queued_names(service) == ["marker"], 30, "a later file queued")
    service.shutdown()

    service, _ = service_factory(settings)  # the start-up scan sees song.wav again
    assert queue(service)["pause_reason"] == "user"  # the user's pause survives a restart
    drop(settings.paths.inbox, tmp_path, "marker2.wav", 1.0, seed=2)
    wait_for(lambda: queued_names(service) == ["marker", "marker2"], 30, "a later file queued")
    assert [j["state"] for j in jobs_named(service, "song")] == ["cancelled"]
    assert song.is_file()
    cli.ok("start")
    os.utime(song, ns=(song.stat().st_atime_ns, song.stat().st_mtime_ns + 10**9))
    wait_for(
        lambda: [j["state"] for j in jobs_named(service, "song")].count("done") == 1,
        120,
        "the changed file queued again and separated",
    )
    assert [j["state"] for j in jobs_named(service, "song")] == ["done", "cancelled"]


@pytest.mark.slow
def test_with_the_api_off_the_cli_says_so(tmp_path, model_repo, capsys, service_factory):
    config = write_config(tmp_path, model_repo, api={"enabled": False})
    settings = load_settings(config)
    assert settings.api.enabled is False
    service, _ = service_factory(settings)
    assert service.api is None
    code, _, err = Cli(config, capsys)("pause")
    assert code == 1 and f"pid {os.getpid()}" in err and "local API is not" in err


@pytest.mark.slow
def test_the_browser_command_line_never_holds_the_token(
    config, service_factory, tmp_path, monkeypatch
):
    """`open` and the tray start a browser, whose command line every local user can read
    (`ps`): it carries a one-time code that opens the page once, never the token."""
    from stemdeck_watch.ui.desktop.tray import Tray

    service, _ = service_factory(load_settings(config))
    token = service.api.token
    record = tmp_path / "launched.jsonl"
    launchers = tmp_path / "bin"
    launchers.mkdir()
    for name in ("browser", "xdg-open"):  # what webbrowser ($BROWSER) and the tray start
        fake = launchers / name
        fake.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"with open({str(record)!r}, 'a') as out:\n"
            f"    out.write(json.dumps(sys.argv) + '\\n')\n"
        )
        fake.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "open"],
        env={**os.environ, "BROWSER": str(launchers / "browser")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("PATH", f"{launchers}{os.pathsep}{os.environ['PATH']}")
    Tray(service, threading.Event()).open_page()
    launched = wait_for(
        lambda: record.is_file() and len(lines := record.read_text().splitlines()) == 2 and lines,
        10,
        "the tray's opener to run",
    )
    argvs = [json.loads(line) for line in launched]
    assert [Path(argv[0]).name for argv in argvs] == ["browser", "xdg-open"]
    for argv in argvs:
        assert not any(token in arg for arg in argv), argv
        assert argv[-1].startswith(f"{service.api.url}#code=")
        assert trade(service, argv[-1]) == (200, token)  # the page's one trade ...
        assert trade(service, argv[-1]) == (403, None)  # ... and nobody's after it
