"""Open a folder or a web address the way the platform does: `xdg-open` on Linux and the BSDs,
`open` on macOS, `os.startfile` on Windows.

Used by the tray (Open inbox / outbox / failed, Open queue page). The opener is started and
left alone: it is the desktop's job (a file manager, a browser) and may outlive the call; its
exit status is collected by a short-lived reaper thread so that no zombie stays behind. A
missing opener is an OSError whose message says what to install.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


def opener_command(platform: str = sys.platform) -> list[str] | None:
    """The command that opens a path or URL here (None on Windows: os.startfile)."""
    if platform.startswith("win"):
        return None
    if platform == "darwin":
        return ["open"]
    return ["xdg-open"]


def open_target(
    target: str | Path,
    *,
    platform: str = sys.platform,
    spawn: Callable[[list[str]], subprocess.Popen] | None = None,
) -> None:
    """Open `target` (a folder or an http URL) with the platform's opener; OSError if that
    cannot be started. Returns at once: the opener runs on its own."""
    text = str(target)
    command = opener_command(platform)
    if command is None:
        os.startfile(text)  # type: ignore[attr-defined]  # Windows only
        return
    if shutil.which(command[0]) is None:
        hint = "the xdg-utils package" if command[0] == "xdg-open" else command[0]
        raise OSError(f"cannot open {text}: {command[0]} is not installed (install {hint})")
    proc = (spawn or _spawn)([*command, text])
    reaper = threading.Thread(target=_reap, args=(proc, text), name="stemdeck-opener", daemon=True)
    reaper.start()


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _reap(proc: subprocess.Popen, target: str) -> None:
    _out, err = proc.communicate()
    if proc.returncode:
        detail = (err or b"").decode(errors="replace").strip().splitlines()
        log.warning(
            "could not open %s: %s exited with %s%s",
            target,
            proc.args[0],
            proc.returncode,
            f" ({detail[-1]})" if detail else "",
        )
