"""A failed job's input goes to `failed/` with `<file>.error.txt` beside it.

The diagnosis is written for two readers: the musician (first lines: what went wrong and
what to do) and whoever debugs it (stage, traceback, the worker's last words, versions).
The input is moved, never deleted; if even that fails it stays where it is and the diagnosis
says so.
"""

from __future__ import annotations

import datetime as _dt
import logging
import platform
import sys
from pathlib import Path, PurePosixPath
from typing import Callable

from stemdeck_watch import __version__
from stemdeck_watch.core.choices import move_sidecar, sidecar_of
from stemdeck_watch.core.errors import FilesystemError
from stemdeck_watch.core.jobs import FileSignature, Job
from stemdeck_watch.core.paths import (
    exists_or_unreachable,
    is_unreachable,
    link_below,
    move_file,
    report_path,
    unique_path,
)
from stemdeck_watch.util.safefile import write_replacing
from stemdeck_watch.util.safetext import strip_controls

log = logging.getLogger(__name__)


def versions(worker_versions: dict[str, str] | None = None) -> dict[str, str]:
    found = {
        "stemdeck-watch": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    for module in ("av", "numpy", "soundfile", "watchdog"):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, "__version__"):
            found[module] = str(mod.__version__)
    found.update(worker_versions or {})
    return found


def quarantine(
    job: Job,
    failed_dir: Path,
    *,
    stage: str,
    message: str,
    details: str = "",
    worker_tail: str = "",
    worker_versions: dict[str, str] | None = None,
    defer: Callable[[Path, Path, str], None] | None = None,
    attempts: str = "",
) -> Path:
    """Move the job's input into `failed_dir` and write the diagnosis; returns where the input
    is now (its old place if it could not be moved).

    An input that cannot be reached (its share is away) is not "no longer there": with
    `defer` the move is handed over (source, target, why) to be done when the share answers,
    and the report says so.

    Only the file the job took is moved: a new version saved over it while the job ran was
    never separated, so it stays in the inbox (the intake queues it as new content) and the
    report says so. `attempts`: one line per attempt a machine fault cut off (the worker
    died, stalled, ran out of memory), when those are why the song failed.
    """
    source = Path(job.source)
    target = failed_dir / PurePosixPath(job.rel_path)
    where = source
    move_note = ""
    unreachable: str | None = None
    try:
        found = exists_or_unreachable(source)
        current: FileSignature | None = FileSignature.of(found) if found is not None else None
    except OSError as exc:
        current, unreachable = None, str(exc.strerror or exc)
    if unreachable is not None:
        move_note = _deferred(source, target, unreachable, defer)
    elif current is None:
        move_note = f"The input {source} was no longer there to move."
    elif job.signature is not None and current != job.signature:
        move_note = (
            f"The input {source} was replaced by a new version after this job took "
            f"it. The new version stays in the inbox and is separated as a new job; "
            f"this report is about the old version."
        )
        log.info("%s changed while its job ran; the new version stays in the inbox", source)
    else:
        try:
            where = move_file(
                source,
                target,
                companion=lambda path: (report_path(path), sidecar_of(path)),
                within=failed_dir,
            )
        except FilesystemError as exc:
            if is_unreachable(exc):
                move_note = _deferred(source, target, str(exc), defer)
            else:
                move_note = f"The input stays at {source}: {exc}."
            log.error("%s", exc)
        else:
            move_sidecar(source, where)  # the song's choices go with it
    report = report_path(where) if where != source else unique_path(report_path(target))
    if where == source and link_below(failed_dir, report.parent) is not None:
        report = unique_path(failed_dir / report.name)  # never written through that link
    text = _diagnosis(
        job,
        stage=stage,
        message=message,
        details=details,
        worker_tail=worker_tail,
        versions=versions(worker_versions),
        where=where,
        move_note=move_note,
        attempts=attempts,
    )
    try:
        report.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(report, text)
    except OSError as exc:
        log.error("%s", FilesystemError("write", report, reason=exc))
    return where


def _deferred(
    source: Path, target: Path, why: str, defer: Callable[[Path, Path, str], None] | None
) -> str:
    if defer is None:
        return f"The input stays at {source}: it could not be reached ({why})."
    defer(source, target, why)
    return (
        f"The input {source} could not be reached ({why}); it is moved here when its share answers."
    )


def _diagnosis(
    job: Job,
    *,
    stage: str,
    message: str,
    details: str,
    worker_tail: str,
    versions: dict[str, str],
    where: Path,
    move_note: str,
    attempts: str = "",
) -> str:
    """The report. Names, paths and messages come from whoever named the file: their control
    characters are shown as `?`, so none adds a line of its own or reaches a terminal that
    shows the report (the worker's lines and details keep their line breaks)."""
    shown = strip_controls
    lines = [
        f"stemdeck-watch could not separate {shown(Path(job.rel_path).name)}",
        "",
        f"What went wrong: {shown(message)}",
        "",
        f"To try again, fix the cause, then run `stemdeck-watch retry {job.id}` (or drop the "
        f"file into the inbox again).",
        f"\n{shown(move_note)}\n" if move_note else "",
        f"Stage:   {stage}",
        f"Job:     {job.id}{f' (preset {shown(job.preset)})' if job.preset else ''}",
        f"Input:   {shown(job.source)}",
        f"Now at:  {shown(where)}",
        f"Time:    {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]
    if attempts.strip():
        lines += [
            "",
            "Every attempt failed because of the machine, not the song (the worker "
            "died, stalled or ran out of memory), and the song was tried again each time:",
            shown(attempts.rstrip(), keep="\n\t"),
        ]
    if worker_tail.strip():
        lines += [
            "",
            "Last lines from the separation worker:",
            shown(worker_tail.rstrip(), keep="\n\t"),
        ]
    if details.strip():
        lines += ["", "Details:", shown(details.rstrip(), keep="\n\t")]
    return "\n".join(lines) + "\n"
