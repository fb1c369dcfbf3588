"""`status`: what the queue holds, read straight from the registry on disk.

Reading the registry (never the running service) is what makes `status` work while the
service is stopped, and keeps it fast: no torch, no worker, no network.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from pathlib import Path
from typing import Any

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import StemdeckError
from stemdeck_watch.core.jobs import Job, JobKind, JobState, made_by_words
from stemdeck_watch.core.lock import running_pid
from stemdeck_watch.engine.eta import eta_words, stored as stored_eta
from stemdeck_watch.store.registry import REGISTRY_FILE, PendingMove, Registry
from stemdeck_watch.store.snapshot import RECENT_JOBS, build_snapshot, workers_of
from stemdeck_watch.ui.web import discovery
from stemdeck_watch.util.safetext import escape_controls


class RegistryDamaged(StemdeckError):
    """The registry file exists but SQLite cannot read it."""


def collect(settings: Settings, every_job: bool = False) -> dict[str, Any]:
    """The status object read from the registry on disk (works while the service is stopped);
    `jobs` as in a snapshot, or (`every_job`) the whole history.

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
    older = 0
    workers = None
    eta = None
    pending: list[PendingMove] = []
    notes: list[str] = []
    try:
        registry = Registry.open_readonly(path)
        if registry is not None:
            try:
                if every_job:
                    jobs = registry.jobs()
                else:
                    jobs, older = registry.recent(RECENT_JOBS)
                order = registry.queued_order()
                waiting = registry.waiting()
                pause_reason = registry.get_meta("pause_reason") or None
                workers = workers_of(registry)
                eta = stored_eta(registry, pid is not None)
                try:
                    pending = registry.pending_moves()
                except sqlite3.OperationalError:  # a registry from before pending moves
                    pending = []
                rebuilt = registry.get_meta("rebuilt_from")
                if rebuilt:
                    notes.append(
                        f"the job registry was damaged and rebuilt; the old file is {rebuilt}"
                    )
            finally:
                registry.close()
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):  # locked, unreadable: say so, no traceback
            raise StemdeckError(f"could not read the job registry {path}: {exc}") from None
        jobs, order, waiting, pause_reason = [], [], [], None
    except sqlite3.DatabaseError as exc:
        raise _damaged(path, exc, pid) from None
    return build_snapshot(
        jobs,
        order,
        waiting,
        pause_reason,
        folders,
        _service(folders.state, pid),
        notes,
        workers=workers,
        older=older,
        eta=eta,
        pending=pending,
    )


def _damaged(path: Path, exc: Exception, pid: int | None) -> RegistryDamaged:
    stop = "stop the service, then " if pid else ""
    return RegistryDamaged(
        f"could not read the job registry {path}: {exc}. The file is damaged; {stop}move it "
        f"aside (e.g. to {path.name}.damaged) and start the service again — it starts with an "
        f"empty history, and songs still in the inbox are queued again"
    )


def to_json(status: dict[str, Any]) -> str:
    """`status --json`: indented at the top, one line per job and per waiting file. The same
    object as `json.dumps(status, indent=2)`, ~10× faster for a 10,000-song library (the
    standard library encodes indented JSON in pure Python, compact JSON in C)."""
    compact = json.JSONEncoder(separators=(", ", ": ")).encode
    lines = []
    for key, value in status.items():
        if isinstance(value, list) and value:
            items = ",\n".join(f"    {compact(item)}" for item in value)
            text = f"[\n{items}\n  ]"
        else:
            text = compact(value)
        lines.append(f"  {compact(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}"


def _service(state: Path, pid: int | None) -> dict[str, Any]:
    """Whether the service runs, and (from its discovery file) where its page is reached."""
    service: dict[str, Any] = {"running": pid is not None, "pid": pid}
    found = discovery.read(state) if pid is not None else None
    if found is not None and found.pid == pid and found.page:
        service["page"] = found.page
    return service


def render(status: dict[str, Any], recent: int = 10) -> str:
    """`status` for a terminal. Names, errors and paths come from whoever named the files:
    their control characters are escaped (`\\x1b`, `\\n`), so none reaches the terminal as
    an escape sequence or adds a line of its own."""
    service = status["service"]
    running = f"running (pid {service['pid']})" if service["running"] else "stopped"
    lines = [f"service: {running}"]
    page = service.get("page") or {}
    if page.get("local"):
        lines.append(f"page:    {page['local']} (this computer)")
    for url in page.get("remote") or []:
        lines.append(f"         {escape_controls(url)} (other devices, signed in)")
    if page.get("fingerprint"):
        lines.append(f"         certificate SHA-256 {page['fingerprint']}")
    if status["paused"]:
        why = {
            "user": "paused by you",
            "restore": "jobs restored after a restart wait for Start (or drop a new file)",
            "disk": "the disk is almost full",
            "folder": "a PAUSE file is in the inbox; delete it to start",
            "cluster": "the Ray cluster is unreachable; it starts again when it is back",
            "inbox": "the inbox's share cannot be reached; it starts again when it answers",
            "outbox": "the outbox's share cannot be reached; separated songs wait in "
            "scratch and the queue starts again when it answers",
        }
        lines.append(f"queue:   paused — {why.get(status['pause_reason'], status['pause_reason'])}")
    else:
        lines.append("queue:   running" if service["running"] else "queue:   not paused")
    lines += [f"note:    {escape_controls(note)}" for note in status.get("notes", [])]
    folders = status["folders"]
    lines.append(f"inbox:   {escape_controls(folders['inbox'])}")
    lines.append(f"outbox:  {escape_controls(folders['outbox'])}")
    worker = status.get("worker") or {}
    if worker.get("precision"):
        lines.append(
            f"worker:  {worker.get('model')} in {worker['precision'].get('precision')} "
            f"on {worker.get('device')}, {worker.get('threads')} thread(s) — "
            f"{worker['precision'].get('reason')}"
        )
    compiled = worker.get("compiled") or {}
    if compiled.get("state") not in (None, "off"):
        lines.append(f"compiled: {compiled['state']} — {compiled.get('reason')}")
    lead = worker.get("lead_compiled") or {}  # a recipe's RoFormer
    if lead.get("state") not in (None, "off"):
        lines.append(f"compiled lead: {lead['state']} — {lead.get('reason')}")
    for each in status.get("workers") or []:
        if each.get("executor") == "ray":  # where each Ray worker runs
            lines.append(
                f"worker {each.get('index')}: {each.get('hostname') or '?'} "
                f"({each.get('node_ip') or '?'}), {each.get('device')}, pid "
                f"{each.get('pid') or '-'}, {each.get('job') or 'idle'}"
            )
    if status.get("download"):
        lines.append(f"model:   {escape_controls(status['download']['text'])}")
    job = status["running"]
    now = [job] + [j for j in status.get("active", []) if j["id"] != job["id"]] if job else []
    for i, each in enumerate(now):  # a song publishing behind the one separating, too
        lines.append(
            f"{'now:' if i == 0 else '':<9}{label(each)} — {each['state']} "
            f"{each['progress'] * 100:.0f}%{_attempt(each)}"
        )
        if made_by_words(each.get("made_by")):  # a recipe: which model makes which stem
            lines.append(f"{'':<9}  {escape_controls(made_by_words(each.get('made_by')))}")
    queued = status["queued"]
    lines.append(
        f"queued:  {len(queued)}"
        + (
            ": "
            + ", ".join(label(j) + _attempt(j) for j in queued[:5])
            + (" …" if len(queued) > 5 else "")
            if queued
            else ""
        )
    )
    eta_line = eta_words(status.get("eta"))
    if eta_line:
        lines.append(f"eta:     {eta_line}")
    if status["waiting"]:
        lines.append(
            f"waiting: {len(status['waiting'])} file(s) held back until the queue has room"
        )
    if status.get("pending_moves"):
        lines.append(
            f"pending: {len(status['pending_moves'])} input(s) of finished jobs are "
            f"moved out of the inbox when their share answers"
        )
    finished = [
        j
        for j in status["jobs"]
        if j["state"] in (JobState.DONE.value, JobState.FAILED.value, JobState.CANCELLED.value)
    ]
    if finished:
        lines.append("recent:")
        for j in finished[:recent]:
            when = _dt.datetime.fromtimestamp(j["finished_at"] or j["created_at"]).strftime(
                "%m-%d %H:%M"
            )
            detail = j["output"] if j["state"] == JobState.DONE.value else (j["error"] or "")
            lines.append(f"  {when}  {j['state']:<9} {label(j)}  {_short(detail)}")
            if j["state"] == JobState.DONE.value and made_by_words(j.get("made_by")):
                lines.append(f"{'':<25}{escape_controls(made_by_words(j.get('made_by')))}")
    older = len(finished) - min(len(finished), recent) + status.get("older_jobs", 0)
    if older:
        lines.append(f"  … and {older} older job(s): `stemdeck-watch status --all` lists every job")
    return "\n".join(lines)


def label(job: dict[str, Any]) -> str:
    """A job's name, with its place in its playlist: "Beta (2/3 of My List)", or
    "My List (playlist, 3 entries)" for the playlist link itself; control characters
    escaped."""
    ref = job.get("playlist")
    name = escape_controls(job["name"])
    if not ref:
        return name
    if ref.get("entry"):
        return f"{name} ({ref['entry']}/{ref['entries']} of {escape_controls(ref['name'])})"
    return f"{name} (playlist, {ref['entries']} entries)"


def _attempt(job: dict[str, Any]) -> str:
    """ " (attempt 2: <why the last one ended>)" for a song the machine cut off before (the
    worker died, stalled, ran out of memory); "" for a first attempt."""
    faults = job.get("faults") or []
    if not faults:
        return ""
    return f" (attempt {len(faults) + 1}: {_short(str(faults[-1].get('reason')), 80)})"


def _short(text: str, width: int = 100) -> str:
    text = escape_controls(text.replace("\n", " "))
    return text if len(text) <= width else text[: width - 1] + "…"
