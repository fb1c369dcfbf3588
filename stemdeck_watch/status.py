"""`status`: what the queue holds, read straight from the registry on disk.

Reading the registry (never the running service) is what makes `status` work while the
service is stopped, and keeps it fast: no torch, no worker, no network.
"""
from __future__ import annotations

import datetime as _dt
from typing import Any

from stemdeck_watch.config import Settings
from stemdeck_watch.jobs import Job, JobState
from stemdeck_watch.lock import running_pid
from stemdeck_watch.registry import REGISTRY_FILE, Registry


def collect(settings: Settings) -> dict[str, Any]:
    """The `status --json` object of design §1 (plus `service` and `folders`)."""
    folders = settings.paths
    pid = running_pid(folders.state)
    registry = Registry.open_readonly(folders.state / REGISTRY_FILE)
    jobs: list[Job] = []
    order: list[str] = []
    waiting: list[dict[str, Any]] = []
    pause_reason = None
    if registry is not None:
        try:
            jobs = registry.jobs()
            order = registry.queued_order()
            waiting = [{"source": s, "kind": k.value, "since": t} for s, k, t in registry.waiting()]
            pause_reason = registry.get_meta("pause_reason") or None
        finally:
            registry.close()
    by_id = {job.id: job for job in jobs}
    running = next((job for job in jobs if job.state.is_running), None)
    return {
        "service": {"running": pid is not None, "pid": pid},
        "paused": pause_reason is not None,
        "pause_reason": pause_reason,
        "running": running.to_status() if running else None,
        "queued": [by_id[i].to_status() for i in order if i in by_id],
        "waiting": waiting,
        "jobs": [job.to_status() for job in jobs],
        "folders": {name: str(getattr(folders, name))
                    for name in ("inbox", "outbox", "processed", "failed", "state")},
    }


def render(status: dict[str, Any], recent: int = 10) -> str:
    service = status["service"]
    lines = [f"service: {'running (pid %d)' % service['pid'] if service['running'] else 'stopped'}"]
    if status["paused"]:
        why = {"user": "paused by you", "restore": "jobs restored after a restart wait for Start "
               "(or drop a new file)", "disk": "the disk is almost full"}
        lines.append(f"queue:   paused — {why.get(status['pause_reason'], status['pause_reason'])}")
    else:
        lines.append("queue:   running" if service["running"] else "queue:   not paused")
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
