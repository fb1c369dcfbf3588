"""Machine faults on purpose: a worker fails the way machines fail, at a chosen point of a song.

Off unless `$STEMDECK_WORKER_FAULTS` names a folder (tests and their service, the local
worker process and Ray actors alike: the variable travels with the worker's environment).
Each file in that folder is one fault waiting to happen; its name is `<order>-<kind>`
(e.g. `1-stall`), and it may hold the segment of the song it fires after (default: the
first). The first worker to reach that segment of a song claims the first file, in name
order, by removing it, and fails as `kind` says:

    exit      exit at once (code 70): a crash in a native library
    kill      SIGKILL itself: what the kernel's OOM killer does
    stall     stop reporting progress and hang: a stuck driver, a deadlocked library
    oom-cuda  raise the error torch raises when CUDA runs out of memory
    oom-mps   raise the error torch raises when MPS runs out of memory
    stall-load  hang while loading a model, before reading it (its content is not read)
    stall-build the background compile starts two compiler-like processes (one starting
                one of its own) and hangs, before it imports torch

Each file fires once, so a fault can be made to repeat (two files) or not (one). A file
named `slow` is never claimed: while it is there, every segment takes the seconds it holds
longer, as on a slow machine.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Callable

FAULTS_ENV = "STEMDECK_WORKER_FAULTS"
KINDS = ("exit", "kill", "stall", "oom-cuda", "oom-mps")
LOAD_KINDS = ("stall-load",)  # faults while a model loads, not at a segment
BUILD_KINDS = ("stall-build",)  # faults of the background compile
# a stand-in for a compiler process that starts one of its own; both wait for a signal
COMPILER = (
    "import signal, subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], "
    "stdin=subprocess.DEVNULL); signal.pause()"
)

log = logging.getLogger("stemdeck_watch.worker.faults")


def armed(on_progress: Callable[[float], None]) -> Callable[[float], None]:
    """`on_progress` (called once per segment) with the faults of `$STEMDECK_WORKER_FAULTS`
    in front of it; `on_progress` itself when none are armed."""
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return on_progress
    segments = [0]

    def report(value: float) -> None:
        segments[0] += 1
        _slow(Path(folder) / "slow")
        kind = _claim(Path(folder), segments[0])
        if kind is not None:
            fire(kind)
        on_progress(value)

    return report


def loading() -> None:
    """Fire the first load fault of `$STEMDECK_WORKER_FAULTS`, if one is armed: called as a
    worker starts to load a model."""
    folder = os.environ.get(FAULTS_ENV)
    kind = _claim(Path(folder), None, LOAD_KINDS) if folder else None
    if kind is not None:
        fire(kind.removesuffix("-load"))


def building() -> None:
    """Fire the first build fault of `$STEMDECK_WORKER_FAULTS`, if one is armed: called as
    the background compile starts."""
    folder = os.environ.get(FAULTS_ENV)
    if not folder or _claim(Path(folder), None, BUILD_KINDS) is None:
        return
    import subprocess
    import sys

    for _ in range(2):
        subprocess.Popen([sys.executable, "-c", COMPILER], stdin=subprocess.DEVNULL)
    fire("stall")


def _slow(path: Path) -> None:
    try:
        seconds = float(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return
    threading.Event().wait(seconds)


def _claim(folder: Path, segment: int | None, kinds: tuple[str, ...] = KINDS) -> str | None:
    """The kind of the first fault of `kinds` due at `segment` (None: any), once it is
    claimed (removed)."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return None
    for name in names:
        kind = name.split("-", 1)[-1]
        if kind not in kinds:
            continue
        try:
            due = int((folder / name).read_text().strip() or 1)
        except (OSError, ValueError):
            due = 1
        if segment is not None and due != segment:
            continue
        try:
            (folder / name).unlink()
        except OSError:
            continue  # another worker claimed it
        return kind
    return None


def fire(kind: str) -> None:
    """Fail now, as `kind` says (see the module's list)."""
    log.warning("fault seam: %s", kind)
    if kind == "exit":
        os._exit(70)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stall":
        threading.Event().wait()  # never set: no progress, no end
    elif kind == "oom-cuda":
        import torch

        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "7.79 GiB of which 1.05 GiB is free. (fault seam)"
        )
    elif kind == "oom-mps":
        raise RuntimeError(
            "MPS backend out of memory (MPS allocated: 8.12 GB, other "
            "allocations: 1.02 GB, max allowed: 9.07 GB). Tried to allocate "
            "512.00 MB on private pool. (fault seam)"
        )
