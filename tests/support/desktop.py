"""A real desktop for the tray and desktop-notification tests: Xvfb, a tray host (trayer),
xdotool, ImageMagick's `import` for screenshots, and private D-Bus session buses
(`dbus-run-session`); PyGObject (GTK 3) for pystray's gtk backend, dbus-python for apprise's
`dbus://`.

Locally the tests skip, with the reason, when any of it is missing; under CI=true they fail
instead (`.ci/run` installs the system packages, and `make test` with the extras `.ci/run` sets
installs PyGObject and dbus-python). Every process started here is ended and reaped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

APT = (
    "apt-get install xvfb xauth xdotool imagemagick trayer gir1.2-gtk-3.0 "
    "libgirepository1.0-dev libcairo2-dev pkg-config dbus libdbus-1-dev libglib2.0-dev; "
    "pip install 'PyGObject<3.51' dbus-python (or `make test EXTRAS=test,tray,dbus`)"
)
TRAY_TOOLS = ("Xvfb", "xdotool", "import", "trayer", "dbus-run-session")
NOTIFY_TOOLS = ("dbus-run-session", "dbus-daemon")


def _gtk_importable() -> bool:
    code = "import gi; gi.require_version('Gtk', '3.0'); from gi.repository import Gtk"
    return (
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode
        == 0
    )


def missing(tools: tuple[str, ...], modules: tuple[str, ...], gtk: bool = False) -> str | None:
    absent = [tool for tool in tools if shutil.which(tool) is None]
    absent += [f"the {m} module" for m in modules if importlib.util.find_spec(m) is None]
    if gtk and "the gi module" not in absent and not _gtk_importable():
        absent.append("GTK 3 introspection data (gir1.2-gtk-3.0)")
    if absent:
        return f"no desktop stack: {', '.join(absent)} missing ({APT})"
    return None


def require(reason: str | None) -> None:
    """Skip (locally) or fail (CI=true) when something is missing."""
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the desktop tests")
    pytest.skip(reason)


def require_tray() -> None:
    require(missing(TRAY_TOOLS, ("gi",), gtk=True))


def require_desktop_notifications() -> None:
    require(missing(NOTIFY_TOOLS, ("gi", "dbus")))


# ---------------------------------------------------------------- processes


def end(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
    """Signal `proc` (if still running) and reap it; SIGKILL after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@contextlib.contextmanager
def xvfb(size: str = "640x480x24") -> Iterator[str]:
    """A fresh X server; yields its DISPLAY (":N")."""
    read, write = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write), "-screen", "0", size, "-nolisten", "tcp"],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write)
    try:
        with os.fdopen(read) as pipe:
            number = pipe.readline().strip()
        if not number:
            raise RuntimeError("Xvfb did not report a display number")
        yield f":{number}"
    finally:
        end(proc)


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A process with its output in `log`; ended (SIGTERM) and reaped on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            yield proc
        finally:
            end(proc)


def screenshot(display: str):
    """The whole screen as a Pillow image (ImageMagick's `import`)."""
    from PIL import Image

    png = subprocess.run(
        ["import", "-display", display, "-window", "root", "png:-"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    return Image.open(io.BytesIO(png)).convert("RGB")


def xdotool(display: str, *args: str) -> None:
    subprocess.run(
        ["xdotool", *args],
        env=dict(os.environ, DISPLAY=display),
        check=True,
        capture_output=True,
        timeout=30,
    )


def bbox(
    image, match, region: tuple[int, int, int, int] | None = None
) -> tuple[int, int, int, int] | None:
    """Bounding box (x0, y0, x1, y1) of the pixels for which `match(rgb)` holds, and how many
    there are must be at least 20; None otherwise."""
    x0, y0, x1, y1 = region or (0, 0, *image.size)
    pixels = image.load()
    xs, ys = [], []
    for y in range(y0, min(y1, image.size[1])):
        for x in range(x0, min(x1, image.size[0])):
            if match(pixels[x, y]):
                xs.append(x)
                ys.append(y)
    if len(xs) < 20:
        return None
    return min(xs), min(ys), max(xs) + 1, max(ys) + 1


def near(colour: tuple[int, int, int], tolerance: int = 6):
    return lambda rgb: all(abs(a - b) <= tolerance for a, b in zip(rgb, colour))
