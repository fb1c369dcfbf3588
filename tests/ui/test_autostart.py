"""`stemdeck-watch autostart [--remove] [--headless]` in a temporary home: the files it writes
for each platform, that it never overwrites or removes a file it did not write, that the
systemd unit passes `systemd-analyze verify`, and that examples/ holds exactly what it writes."""

from __future__ import annotations

import configparser
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import desktop
from stemdeck_watch.cli.main import main
from stemdeck_watch.ui.desktop import autostart


REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
# what examples/ shows: (platform, home, executable, config, headless, file in examples/)
EXAMPLE_CASES = [
    (
        "linux",
        "/home/you",
        ["/home/you/stemdeck-watch/.venv/bin/stemdeck-watch"],
        "/home/you/.config/stemdeck-watch/stemdeck.toml",
        False,
        "stemdeck-watch.desktop",
    ),
    (
        "linux",
        "/home/you",
        ["/home/you/stemdeck-watch/.venv/bin/stemdeck-watch"],
        "/home/you/.config/stemdeck-watch/stemdeck.toml",
        True,
        "stemdeck-watch.service",
    ),
    (
        "darwin",
        "/Users/you",
        ["/Users/you/stemdeck-watch/.venv/bin/stemdeck-watch"],
        "/Users/you/Library/Application Support/stemdeck-watch/stemdeck.toml",
        False,
        "io.stemdeck.watch.plist",
    ),
    (
        "win32",
        "C:\\Users\\you",
        ["C:\\Users\\you\\stemdeck-watch\\.venv\\Scripts\\stemdeck-watch.exe"],
        "C:\\Users\\you\\AppData\\Local\\stemdeck-watch\\stemdeck.toml",
        False,
        "stemdeck-watch.cmd",
    ),
]


def example_entry(platform, home, exe, config, headless, _name) -> autostart.Entry:
    env = {"APPDATA": f"{home}\\AppData\\Roaming"} if platform == "win32" else {}
    return autostart.entry_for(
        platform, Path(home), autostart.command(config, headless, exe), config, headless, env
    )


def write_config(folder: Path) -> Path:
    path = folder / "stemdeck.toml"
    path.write_text(
        "[folders]\n"
        + "".join(
            f'{name} = "{folder / name}"\n'
            for name in ("inbox", "outbox", "processed", "failed", "state")
        )
    )
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG and systemd files are Linux's")
def test_linux_autostart_writes_and_removes_its_files(home, tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["--config", str(config), "autostart"]) == 0
    desktop_file = home / ".config" / "autostart" / "stemdeck-watch.desktop"
    out = capsys.readouterr().out
    assert f"wrote {desktop_file}" in out and f"it runs with the config {config}" in out
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(desktop_file)
    section = entry["Desktop Entry"]
    assert section["Type"] == "Application" and section["Terminal"] == "false"
    assert section["Exec"] == (
        f"{autostart.executable()[0]} --config {config} run"
        if " " not in str(config)
        else section["Exec"]
    )
    assert "--no-tray" not in section["Exec"]

    assert main(["--config", str(config), "autostart", "--headless"]) == 0
    unit = home / ".config" / "systemd" / "user" / "stemdeck-watch.service"
    out = capsys.readouterr().out
    assert f"wrote {unit}" in out
    assert (
        "systemctl --user daemon-reload && systemctl --user enable --now "
        "stemdeck-watch.service" in out
    )
    text = unit.read_text()
    assert "run --no-tray" in text and f"--config {config}" in text
    assert "WantedBy=default.target" in text

    # again: its own files are updated in place
    assert main(["--config", str(config), "autostart", "--headless"]) == 0
    assert f"updated {unit}" in capsys.readouterr().out

    assert main(["autostart", "--remove"]) == 0
    out = capsys.readouterr().out
    assert f"removed {desktop_file}" in out and f"removed {unit}" in out
    assert "systemctl --user disable --now stemdeck-watch.service" in out
    assert not desktop_file.exists() and not unit.exists()
    assert main(["autostart", "--remove"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG and systemd files are Linux's")
def test_a_file_it_did_not_write_is_never_overwritten_nor_removed(
    home, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    config = write_config(tmp_path)
    mine = tmp_path / "xdg" / "autostart" / "stemdeck-watch.desktop"
    mine.parent.mkdir(parents=True)
    mine.write_text("[Desktop Entry]\nName=my own\n")
    assert main(["--config", str(config), "autostart"]) == 1
    assert (
        "was not written by `stemdeck-watch autostart`; leaving it alone" in capsys.readouterr().err
    )
    assert mine.read_text() == "[Desktop Entry]\nName=my own\n"
    assert main(["autostart", "--remove"]) == 0
    assert f"left {mine} alone" in capsys.readouterr().out
    assert mine.read_text() == "[Desktop Entry]\nName=my own\n"


def test_without_a_config_file_it_says_the_defaults_are_used(home, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nothing-here"))
    if sys.platform != "linux":
        pytest.skip("the default config search differs per platform")
    assert main(["autostart"]) == 0
    out = capsys.readouterr().out
    assert "built-in defaults" in out and "stemdeck-watch config init" in out
    written = tmp_path / "nothing-here" / "autostart" / "stemdeck-watch.desktop"
    exec_line = next(line for line in written.read_text().splitlines() if line.startswith("Exec="))
    assert exec_line.endswith(" run") and "--config" not in exec_line


def test_macos_and_windows_files(tmp_path):
    exe = [str(tmp_path / "venv" / "bin" / "stemdeck-watch")]
    config = tmp_path / "My Music" / "stemdeck.toml"
    mac = autostart.entry_for(
        "darwin", tmp_path, autostart.command(config, False, exe), config, False
    )
    assert autostart.install(mac) == "wrote"
    assert mac.path == tmp_path / "Library" / "LaunchAgents" / "io.stemdeck.watch.plist"
    plist = plistlib.loads(mac.path.read_bytes())
    assert plist["ProgramArguments"] == [*exe, "--config", str(config), "run"]
    assert plist["RunAtLoad"] is True and plist["Label"] == "io.stemdeck.watch"
    headless = autostart.entry_for(
        "darwin", tmp_path, autostart.command(config, True, exe), config, True
    )
    assert autostart.install(headless) == "updated"
    assert plistlib.loads(mac.path.read_bytes())["ProgramArguments"][-1] == "--no-tray"

    win = autostart.entry_for(
        "win32",
        tmp_path,
        autostart.command(config, False, exe),
        config,
        False,
        env={"APPDATA": str(tmp_path / "Roaming")},
    )
    assert autostart.install(win) == "wrote"
    assert win.path == (
        tmp_path
        / "Roaming"
        / "Microsoft"
        / "Windows"
        / "Start Menu"
        / "Programs"
        / "Startup"
        / "stemdeck-watch.cmd"
    )
    raw = win.path.read_bytes()
    assert b"\r\n" in raw and f'"{config}"'.encode() in raw
    removed, foreign = autostart.remove([mac.path, win.path, tmp_path / "absent"])
    assert removed == [mac.path, win.path] and foreign == []


def test_quoting_for_each_format():
    argv = ["/opt/my apps/stemdeck-watch", "--config", '/x/100% $HOME "q"\\b.toml', "run"]
    assert autostart.desktop_exec(argv) == (
        '"/opt/my apps/stemdeck-watch" --config "/x/100%% \\\\$HOME \\\\"q\\\\"\\\\\\\\b.toml" run'
    )
    assert autostart.systemd_exec(argv) == (
        '"/opt/my apps/stemdeck-watch" --config "/x/100%% $$HOME \\"q\\"\\\\b.toml" run'
    )
    assert autostart.windows_cmdline(["C:\\a b\\x.exe", "run"]) == '"C:\\a b\\x.exe" run'


def cmd_exe_reads(line: str) -> str:
    """The text a batch file's line becomes before cmd.exe runs it (phase 1: `%%` is `%`),
    failing where cmd.exe would do more than read characters: a lone `%` (a variable or a
    batch argument), or `&`, `|`, `<`, `>`, `^`, `(`, `)`, `,`, `;`, `=` outside double
    quotes (operators, escapes, blocks, separators)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "%":
            assert line[i + 1 : i + 2] == "%", f"cmd.exe would expand the % at {i}: {line!r}"
            i += 1
        out.append(line[i])
        i += 1
    text, quoted = "".join(out), False
    for i, c in enumerate(text):
        if c == '"':
            quoted = not quoted
        elif not quoted:
            assert c not in "&|<>^(),;=", f"cmd.exe would read {c!r} at {i} as syntax: {text!r}"
    assert not quoted, text
    return text


def command_line_to_argv(text: str) -> list[str]:
    """Split a Windows command line as the program's C runtime does (CommandLineToArgvW):
    whitespace separates outside quotes; 2n backslashes before a quote are n and the quote
    opens or closes; 2n+1 are n and a literal quote; other backslashes are literal."""
    args: list[str] = []
    current: list[str] = []
    quoted = started = False
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            n = len(text[i:]) - len(text[i:].lstrip("\\"))
            if text[i + n : i + n + 1] == '"':
                current.append("\\" * (n // 2))
                if n % 2:
                    current.append('"')
                    i += n + 1
                else:
                    i += n
                started = True
                continue
            current.append("\\" * n)
            i += n
            started = True
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c in " \t" and not quoted:
            if started:
                args.append("".join(current))
                current, started = [], False
        else:
            current.append(c)
            started = True
        i += 1
    if started:
        args.append("".join(current))
    return args


def test_a_windows_path_with_ampersand_parentheses_or_caret_starts_the_right_program(tmp_path):
    exe = ["C:\\Users\\R&D\\stemdeck^watch(2)\\.venv\\Scripts\\stemdeck-watch.exe"]
    config = "C:\\Users\\Tom & Jerry\\100%\\a,b;c=d!\\stemdeck.toml"
    for argv in (
        autostart.command(config, False, exe),
        autostart.command(config, True, ["C:\\Py thon\\python.exe", "-m", "stemdeck_watch"]),
        ["C:\\x.exe", "C:\\folder with space\\", "%PATH%", "%1", "a^b"],
    ):
        entry = autostart.entry_for(
            "win32",
            tmp_path,
            argv,
            Path(config),
            False,
            env={"APPDATA": "C:\\Users\\you\\AppData\\Roaming"},
        )
        lines = entry.text.split("\r\n")
        assert lines[0] == "@echo off" and lines[-1] == ""
        assert lines[1].startswith("rem ") and "%%" in lines[1]  # the rem line's % too
        assert lines[2] == "setlocal DisableDelayedExpansion"  # `!` stays a character
        start = cmd_exe_reads(lines[3])
        assert start.startswith('start "stemdeck-watch" /min ')
        assert command_line_to_argv(start.removeprefix('start "stemdeck-watch" /min ')) == argv
    with pytest.raises(ValueError, match="double quote"):
        autostart.windows_cmdline(['C:\\a"b.exe'])


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:  # skipped locally, never under CI=true
        desktop.require(
            "systemd-analyze is not installed here (apt-get install systemd); "
            "systemd's own check of the unit file cannot run"
        )
    # an executable under a folder with a space: the quoting must hold for systemd too
    exe = tmp_path / "my venv" / "bin" / "stemdeck-watch"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    config = tmp_path / "my config" / "stemdeck.toml"
    entry = autostart.entry_for(
        "linux", tmp_path, autostart.command(config, True, [str(exe)]), config, True, env={}
    )
    autostart.install(entry)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(entry.path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
    )
    assert result.returncode == 0, result.stderr
    assert "stemdeck-watch.service" not in result.stderr, result.stderr


@pytest.mark.parametrize("case", EXAMPLE_CASES, ids=[c[-1] for c in EXAMPLE_CASES])
def test_examples_hold_what_autostart_writes(case):
    entry = example_entry(*case)
    assert (EXAMPLES / case[-1]).read_bytes() == entry.text.encode(), (
        f"examples/{case[-1]} is out of date: regenerate it with tests/ui/test_autostart.py "
        f"(python tests/ui/test_autostart.py)"
    )


if __name__ == "__main__":  # regenerate examples/
    for case in EXAMPLE_CASES:
        (EXAMPLES / case[-1]).write_bytes(example_entry(*case).text.encode())
        print(f"wrote examples/{case[-1]}")
