"""Desktop notifications end to end, on a private session bus: run under `dbus-run-session`.

Starts the stand-in notification service (notify_standin.py), then the service's Notifier
with `notify.urls = ["desktop"]`, publishes a finished song on the event bus, and reads what the
stand-in received; then the same through apprise's `glib://` (the PyGObject route). Prints one
JSON object: the URL "desktop" resolved to and the notifications received.

    dbus-run-session -- python tests/support/notify_desktop_check.py WORKDIR [SONG NAME]
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from stemdeck_watch.core.config import settings_from_dict  # noqa: E402
from stemdeck_watch.ui.desktop.notify import Note, Notifier, Target  # noqa: E402
from stemdeck_watch.core.events import EventBus, JobChanged  # noqa: E402
from stemdeck_watch.core.jobs import Job, JobKind, JobState  # noqa: E402


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if ready:
            return proc.stdout.readline().strip()
    raise TimeoutError(f"nothing from the stand-in within {timeout} s")


def main(workdir: Path, name: str = "Desk Song") -> None:
    standin = subprocess.Popen(
        [sys.executable, str(HERE / "notify_standin.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    result: dict = {"received": []}
    try:
        assert read_line(standin, 20) == "ready"
        folders = {k: str(workdir / k) for k in ("inbox", "outbox", "processed", "failed", "state")}
        settings = settings_from_dict({"folders": folders, "notify": {"urls": ["desktop"]}})
        bus = EventBus()
        notifier = Notifier(bus, settings, window=0)
        notifier.start()
        try:
            result["labels"] = [c.target.label for c in notifier.channels]
            bus.publish(
                JobChanged(
                    Job(
                        id="j1",
                        name=name,
                        kind=JobKind.FILE,
                        state=JobState.DONE,
                        source=str(workdir / "processed" / f"{name}.wav"),
                        rel_path=f"{name}.wav",
                        output=str(workdir / "outbox" / name),
                    )
                )
            )
            result["received"].append(json.loads(read_line(standin, 20)))
        finally:
            notifier.stop()
        result["glib_sent"] = Target("glib://").send(Note("done", "Through glib", "hello"))[0]
        result["received"].append(json.loads(read_line(standin, 20)))
    finally:
        standin.stdin.close()
        try:
            standin.wait(10)
        except subprocess.TimeoutExpired:
            standin.kill()
            standin.wait()
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])
