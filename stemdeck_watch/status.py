"""`status`: what the queue holds, read straight from the registry on disk.

Reading the registry (never the running service) is what makes `status` work while the
service is stopped, and keeps it fast: no torch, no worker, no network.
"""
from __future__ import annotations

import datetime as _dt
import sqlite3
from pathlib import Path
from typing import Any

from stemdeck_watch.config import Folders, Settings
from stemdeck_watch.errors import StemdeckError
from stemdeck_watch.jobs import Job, JobKind, JobState
from stemdeck_watch.lock import running_pid
from stemdeck_watch.registry import REGISTRY_FILE, Registry


class RegistryDamaged(StemdeckError):
    """The registry file exists but SQLite cannot read it."""


def build(jobs: list[Job], order: list[str], waiting: list[tuple[str, JobKind, float]],
          pause_reason: str | None, folders: Folders,
          service: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The `status --json` object of design §1 (plus `service` and `folders`).

    One builder for the stopped service (read from disk) and the running one (the API), so
    the CLI, the page and scripts see the same shape.
    """
    by_id = {job.id: job for job in jobs}
    running = next((job for job in jobs if job.state.is_running), None)
    return {
        "service": service,
        "paused": pause_reason is not None,
        "pause_reason": pause_reason,
        "running": running.to_status() if running else None,
        "queued": [by_id[i].to_status() for i in order if i in by_id],
        "waiting": [{"source": s, "kind": k.value, "since": t} for s, k, t in waiting],
        "jobs": [job.to_status() for job in jobs],
        "folders": {name: str(getattr(folders, name))
                    for name in ("inbox", "outbox", "processed", "failed", "state")},
        "notes": notes or [],
    }


def collect(settings: Settings) -> dict[str, Any]:
    """The status object read from the registry on disk (works while the service is stopped).

    A registry the service has only just created has no tables yet: that is "no jobs yet",
    not an error. A damaged file is named, with what to do about it.
    """
    folders = settings.paths
    pid = running_pid(folders.state)
    path = folders.state / REGISTRY_FILE
    jobs: list[Job] = []
    order: list[str] = []
    waiting: list[tuple[str, JobKind, float]] = []
    pause_reason = None
    notes: list[str] = []
    try:
        registry = Registry.open_readonly(path)
        if registry is not None:
            try:
                jobs = registry.jobs()
                order = registry.queued_order()
                waiting = registry.waiting()
                pause_reason = registry.get_meta("pause_reason") or None
                rebuilt = registry.get_meta("rebuilt_from")
                if rebuilt:
                    notes.append(f"the job registry was damaged and rebuilt; the old file is "
                                 f"{rebuilt}")
            finally:
                registry.close()
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):  # locked, unreadable: say so, no traceback
            raise StemdeckError(f"could not read the job registry {path}: {exc}") from None
        jobs, order, waiting, pause_reason = [], [], [], None
    except sqlite3.DatabaseError as exc:
        raise _damaged(path, exc, pid) from None
    return build(jobs, order, waiting, pause_reason, folders,
                 {"running": pid is not None, "pid": pid}, notes)


def _damaged(path: Path, exc: Exception, pid: int | None) -> RegistryDamaged:
    stop = "stop the service, then " if pid else ""
    return RegistryDamaged(
        f"could not read the job registry {path}: {exc}. The file is damaged; {stop}move it "
        f"aside (e.g. to {path.name}.damaged) and start the service again — it starts with an "
        f"empty history, and songs still in the inbox are queued again")


def render(status: dict[str, Any], recent: int = 10) -> str:
    service = status["service"]
    lines = [f"service: {'running (pid %d)' % service['pid'] if service['running'] else 'stopped'}"]
    if status["paused"]:
        why = {"user": "paused by you", "restore": "jobs restored after a restart wait for Start "
               "(or drop a new file)", "disk": "the disk is almost full",
               "folder": "a PAUSE file is in the inbox; delete it to start"}
        lines.append(f"queue:   paused — {why.get(status['pause_reason'], status['pause_reason'])}")
    else:
        lines.append("queue:   running" if service["running"] else "queue:   not paused")
    lines += [f"note:    {note}" for note in status.get("notes", [])]
    folders = status["folders"]
    lines.append(f"inbox:   {folders['inbox']}")
    lines.append(f"outbox:  {folders['outbox']}")
    job = status["running"]
    if job:
        lines.append(f"now:     {job['name']} — {job['state']} {job['progress'] * 100:.0f}%")
    queued = status["queued"]
    lines.append(f"queued:  {len(queued)}" + (": " + ", ".join(j["name"] for j in queued[:5])
                                              + (" …" if len(queued) > 5 else "") if queued else ""))
    if status["waiting"]:
        lines.append(f"waiting: {len(status['waiting'])} file(s) held back until the queue has room")
    finished = [j for j in status["jobs"] if j["state"] in
                (JobState.DONE.value, JobState.FAILED.value, JobState.CANCELLED.value)]
    if finished:
        lines.append("recent:")
        for j in finished[:recent]:
            when = _dt.datetime.fromtimestamp(j["finished_at"] or j["created_at"]).strftime("%m-%d %H:%M")
            detail = j["output"] if j["state"] == JobState.DONE.value else (j["error"] or "")
            lines.append(f"  {when}  {j['state']:<9} {j['name']}  {_short(detail)}")
    return "\n".join(lines)


def _short(text: str, width: int = 100) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"
