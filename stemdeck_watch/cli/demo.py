"""`demo`: the whole product, offline, in a minute.

Makes a workspace, saves a tiny untrained HTDemucs in demucs's local-repo format, synthesises
two short songs, runs the real service (watcher, registry, worker process, publish) on them
and prints where the stems are and how long each step took.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import tomli_w

from stemdeck_watch.core.config import Settings, default_toml, load_settings
from stemdeck_watch.core.events import EventBus, JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import MANIFEST, read_manifest
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

SONGS = (("demo-song-1.wav", 8.0, 1), ("demo-song-2.flac", 6.0, 2))
TIMEOUT = 600.0

UNTRAINED_NOTE = """\
Note: the demo uses a tiny model that has never been trained, so its "stems" are not
musically meaningful — the demo shows the service, not separation quality. For real stems,
use a real Demucs model: leave separation.model = "htdemucs" (downloaded once, on first use,
from the model hub), or put downloaded model files in a folder and set
separation.model_repo to it (docs/guide/models.md, "Using a real model offline"). Then:
    {command} doctor && {command} run{where}"""
SCRIPT = "stemdeck-watch"


def untrained_note(
    prefix: Path | None = None,
    path: str | None = None,
    argv0: str | None = None,
    executable: str | None = None,
) -> str:
    """The demo's last words, with the command as this installation runs it. The script
    is the one that started this process (sys.argv[0]), else the one installed beside this
    Python (sys.prefix): its name where it is on PATH; `.venv/bin/stemdeck-watch` from the
    clone's folder where it lies in a clone's `.venv` (what `make demo` makes); its full
    path where it is not on PATH (a wheel in a virtual environment not activated); and
    `python -m stemdeck_watch` where there is no script. Read from the paths, not assumed."""
    prefix = Path(sys.prefix if prefix is None else prefix)
    path = os.environ.get("PATH", os.defpath) if path is None else path
    started = Path(sys.argv[0] if argv0 is None else argv0)
    bin_dir = "Scripts" if sys.platform == "win32" else "bin"
    installed = prefix / bin_dir / (SCRIPT + (".exe" if sys.platform == "win32" else ""))
    script = started if started.stem == SCRIPT and started.is_file() else installed
    if not script.is_file():
        command = f"{_quoted(Path(executable or sys.executable))} -m stemdeck_watch"
        return UNTRAINED_NOTE.format(where="", command=command)
    found = shutil.which(SCRIPT, path=path)
    if found and os.path.samefile(found, script):
        return UNTRAINED_NOTE.format(where="", command=SCRIPT)
    venv = script.absolute().parent.parent
    if venv.name == ".venv" and _is_clone(venv.parent):
        return UNTRAINED_NOTE.format(
            where=f"\n(in the clone's folder, {_quoted(venv.parent)}: `make demo` installed it there)",
            command=f"{venv.name}/{script.parent.name}/{script.name}",
        )
    return UNTRAINED_NOTE.format(where="\n(its folder is not on PATH)", command=_quoted(script))


def _is_clone(folder: Path) -> bool:
    """Whether `folder` is this project's source folder (its pyproject.toml names it)."""
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return re.search(r'(?m)^name\s*=\s*"stemdeck-watch"', text) is not None


def _quoted(path: Path) -> str:
    return (
        subprocess.list2cmdline([str(path)]) if sys.platform == "win32" else shlex.quote(str(path))
    )


def make_workspace(root: Path) -> Path:
    """Write the demo's stemdeck.toml (folders inside `root`, the tiny model, fast settle)."""
    data = default_toml()
    data["folders"] = {
        "inbox": "inbox",
        "outbox": "outbox",
        "processed": "processed",
        "failed": "failed",
        "state": "state",
    }
    data["separation"].update(model="tiny", model_repo="models", device="cpu")
    data["watch"]["settle_seconds"] = 0.5
    data["notify"]["urls"] = []
    data["tray"]["enabled"] = False
    config = root / "stemdeck.toml"
    config.write_text(tomli_w.dumps(data), encoding="utf-8")
    return config


def run_demo(workspace: Path | None, emit: Callable[[str], None]) -> int:
    root = Path(workspace or tempfile.mkdtemp(prefix="stemdeck-demo-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    emit(f"demo workspace: {root}")
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "stemdeck_watch.workers.tinymodel",
            str(root / "models"),
            "--name",
            "tiny",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    emit(
        f"saved a tiny untrained HTDemucs to {root / 'models' / 'tiny.th'} "
        f"({time.monotonic() - started:.1f} s)"
    )
    settings = load_settings(make_workspace(root))
    folders = settings.paths
    bus = EventBus()
    finished: dict[str, JobState] = {}
    all_done = threading.Event()

    def on_change(event: JobChanged) -> None:
        if event.job.state.is_final:
            finished[event.job.id] = event.job.state
            if len(finished) >= len(SONGS):
                all_done.set()

    bus.subscribe(JobChanged, on_change)
    service = Service(settings, bus=bus)
    service.start()
    try:
        staging = root / "incoming"
        for name, seconds, seed in SONGS:
            # written beside the inbox, then renamed in: the way browsers and sync clients do it
            tmp = write_song(staging / name, seconds, seed=seed)
            os.replace(tmp, folders.inbox / name)
        dropped = time.monotonic()
        emit(
            f"dropped {len(SONGS)} songs into {folders.inbox}; the service waits until each "
            f"file is complete ({settings.watch.settle_seconds:g} s settle), then separates "
            f"them one at a time in one resident worker process"
        )
        if not all_done.wait(TIMEOUT):
            emit(f"the demo did not finish within {TIMEOUT:.0f} s; see {folders.state / 'logs'}")
            return 1
        elapsed = time.monotonic() - dropped
    finally:
        service.shutdown()
    return _report(settings, elapsed, emit)


def _report(settings: Settings, elapsed: float, emit: Callable[[str], None]) -> int:
    from stemdeck_watch.cli.status import collect

    status = collect(settings)
    emit("")
    ok = True
    for job in reversed(status["jobs"]):  # in the order they were dropped
        if job["state"] != JobState.DONE.value:
            ok = False
            emit(f"{job['name']}: {job['state']} — {job['error']}")
            continue
        output = Path(job["output"])
        manifest = read_manifest(output) or {}
        timings = manifest.get("timings", {})
        stems = ", ".join(entry["file"] for entry in manifest.get("stems", []))
        emit(f"{job['name']} → {output}")
        emit(f"    {stems}, {MANIFEST}")
        emit("    " + ", ".join(f"{step} {seconds:.2f} s" for step, seconds in timings.items()))
    emit(
        f"all songs separated {elapsed:.1f} s after they were dropped; inputs moved to "
        f"{settings.paths.processed}"
    )
    emit("")
    emit(untrained_note())
    return 0 if ok else 1
