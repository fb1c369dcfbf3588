"""`stemdeck-watch autostart [--remove] [--headless]`: start the service at login, the platform's
own way.

| platform | with the tray (default) | `--headless` |
|---|---|---|
| Linux | XDG autostart entry `~/.config/autostart/stemdeck-watch.desktop` (desktop sessions) | systemd user unit `~/.config/systemd/user/stemdeck-watch.service` (prints the `systemctl --user` command to enable it) |
| macOS | LaunchAgent `~/Library/LaunchAgents/io.stemdeck.watch.plist` | the same, with `run --no-tray` |
| Windows | `stemdeck-watch.cmd` in the Startup folder | the same, with `run --no-tray` |

Every file written carries a marker line; a file at that place without the marker was not
written here and is never overwritten or removed. The command line inside names this
installation's executable and the config file it will use (absolute paths), so the service
started at login uses exactly what `stemdeck-watch` uses now.
"""

from __future__ import annotations

import dataclasses
import os
import plistlib
import sys
from pathlib import Path

MARKER = "Written by `stemdeck-watch autostart`"
LABEL = "io.stemdeck.watch"
UNIT = "stemdeck-watch.service"
DESKTOP_FILE = "stemdeck-watch.desktop"
WINDOWS_FILE = "stemdeck-watch.cmd"
DESCRIPTION = "stemdeck-watch: songs dropped into the inbox become stems"


class NotOurs(Exception):
    """A file is where ours would go, and we did not write it."""


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # xdg | systemd | launchagent | startup
    path: Path
    text: str
    after: str = ""  # what to do next (the systemctl command), printed after writing


def executable() -> list[str]:
    """How to start this installation: its `stemdeck-watch` script beside the interpreter,
    else `python -m stemdeck_watch`."""
    here = Path(sys.executable).parent
    for name in ("stemdeck-watch", "stemdeck-watch.exe"):
        if (here / name).is_file():
            return [str(here / name)]
    return [sys.executable, "-m", "stemdeck_watch"]


def command(config: Path | None, headless: bool, exe: list[str] | None = None) -> list[str]:
    argv = list(exe or executable())
    if config is not None:
        argv += ["--config", str(config)]
    argv.append("run")
    if headless:
        argv.append("--no-tray")
    return argv


# ---------------------------------------------------------------- quoting per format


def desktop_exec(argv: list[str]) -> str:
    """The Exec= value of a desktop entry (Desktop Entry Specification: reserved characters
    in double quotes, with `"`, backquote, `$` and `\\` escaped; `%` doubled)."""
    out = []
    for arg in argv:
        arg = arg.replace("%", "%%")
        if arg and not any(c in arg for c in " \t\n\"'\\><~|&;$*?#()`"):
            out.append(arg)
        else:
            escaped = "".join("\\" + c if c in '"`$\\' else c for c in arg)
            out.append(f'"{escaped}"')
    # the value is itself a string: its backslashes are escaped once more
    return " ".join(out).replace("\\", "\\\\")


def systemd_exec(argv: list[str]) -> str:
    """An ExecStart= line: each argument in double quotes with `\\` and `"` escaped; `%`
    doubled (systemd specifiers); `$` doubled (no variable expansion)."""

    def one(arg: str) -> str:
        arg = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
        return f'"{arg}"' if (not arg or any(c.isspace() for c in arg) or "'" in arg) else arg

    return " ".join(one(a) for a in argv)


CMD_SPECIAL = frozenset(" \t&|<>^(),;=!%")  # what cmd.exe reads as more than a character


def windows_cmdline(argv: list[str]) -> str:
    """A command line for a `.cmd` file: an argument holding anything cmd.exe treats
    specially (`&`, `(`, `^`, a space …) goes in double quotes, where cmd.exe takes those
    literally and the program's own parser (CommandLineToArgvW rules) reads it back whole, its
    trailing backslashes doubled so that none escapes the closing quote; `%` is doubled
    everywhere (a batch file expands `%…%` and `%1` even inside quotes). A double quote or
    a control character cannot be passed this way (no Windows path holds one): ValueError."""
    out = []
    for arg in argv:
        if '"' in arg or any(ord(c) < 32 for c in arg):
            raise ValueError(
                f"{arg!r} cannot be written into a .cmd file: it holds a double "
                f"quote or a control character"
            )
        if arg and not CMD_SPECIAL.intersection(arg):
            out.append(arg)
        else:
            out.append('"' + arg + "\\" * (len(arg) - len(arg.rstrip("\\"))) + '"')
    return " ".join(out).replace("%", "%%")


# ---------------------------------------------------------------- the files


def entry_for(
    platform: str,
    home: Path,
    argv: list[str],
    config: Path | None,
    headless: bool,
    env: dict[str, str] | None = None,
) -> Entry:
    env = dict(os.environ if env is None else env)
    uses = f"config: {config}" if config else "config: the default search (no --config)"
    if platform == "darwin":
        path = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        data = {
            "Label": LABEL,
            "ProgramArguments": argv,
            "RunAtLoad": True,
            "ProcessType": "Interactive" if not headless else "Background",
            "KeepAlive": {"SuccessfulExit": False},
        }
        xml = plistlib.dumps(data, sort_keys=False).decode()
        head, sep, rest = xml.partition("<plist")
        text = f"{head}<!-- {MARKER}; {uses} -->\n{sep}{rest}"
        return Entry(
            "launchagent",
            path,
            text,
            f"it starts at your next login; to start it now: launchctl load {path}",
        )
    if platform.startswith("win"):
        appdata = Path(env.get("APPDATA") or home / "AppData" / "Roaming")
        path = (
            appdata / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup" / WINDOWS_FILE
        )
        # `setlocal`: `!` stays literal even where delayed expansion is on by default
        text = (
            f"@echo off\r\nrem {MARKER}; {uses.replace('%', '%%')}\r\n"
            "setlocal DisableDelayedExpansion\r\n"
            f'start "stemdeck-watch" /min {windows_cmdline(argv)}\r\n'
        )
        return Entry("startup", path, text, "it starts at your next login")
    config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    if headless:
        path = config_home / "systemd" / "user" / UNIT
        text = (
            f"# {MARKER}; {uses}\n"
            f"# Enable: systemctl --user daemon-reload && systemctl --user enable --now {UNIT}\n"
            "[Unit]\n"
            f"Description={DESCRIPTION}\n"
            "\n"
            "[Service]\n"
            "Type=exec\n"
            f"ExecStart={systemd_exec(argv)}\n"
            "Restart=on-failure\n"
            "TimeoutStopSec=60\n"
            "\n"
            "[Install]\n"
            "WantedBy=default.target\n"
        )
        return Entry(
            "systemd",
            path,
            text,
            f"enable and start it now with:\n"
            f"  systemctl --user daemon-reload && systemctl --user enable --now {UNIT}\n"
            f"(to keep it running while you are logged out: loginctl enable-linger)",
        )
    path = config_home / "autostart" / DESKTOP_FILE
    text = (
        "[Desktop Entry]\n"
        f"# {MARKER}; {uses}\n"
        "Type=Application\n"
        "Name=stemdeck-watch\n"
        "Comment=Songs dropped into the inbox become stems (tray icon)\n"
        f"Exec={desktop_exec(argv)}\n"
        "Terminal=false\n"
        "X-GNOME-Autostart-enabled=true\n"
    )
    return Entry("xdg", path, text, "it starts with your next desktop session")


def all_places(platform: str, home: Path, env: dict[str, str] | None = None) -> list[Path]:
    """Every place `autostart` may have written to on this platform."""
    probe = ["x"]
    return list(
        dict.fromkeys(
            entry_for(platform, home, probe, None, headless, env).path for headless in (False, True)
        )
    )


def is_ours(path: Path) -> bool:
    try:
        return MARKER in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def install(entry: Entry) -> str:
    """Write `entry` (atomically); 'wrote' or 'updated'. NotOurs if a file we did not write
    is in the way."""
    existed = entry.path.exists()
    if existed and not is_ours(entry.path):
        raise NotOurs(
            f"{entry.path} exists and was not written by `stemdeck-watch autostart`; "
            f"leaving it alone (remove or rename it, then run this again)"
        )
    entry.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.path.with_name(f".{entry.path.name}.tmp")
    newline = "" if entry.kind == "startup" else None
    with open(tmp, "w", encoding="utf-8", newline=newline) as handle:
        handle.write(entry.text)
    os.replace(tmp, entry.path)
    return "updated" if existed else "wrote"


def remove(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """Remove the files among `paths` that we wrote; (removed, left alone because not ours)."""
    removed, foreign = [], []
    for path in paths:
        if not path.exists():
            continue
        if is_ours(path):
            path.unlink()
            removed.append(path)
        else:
            foreign.append(path)
    return removed, foreign
