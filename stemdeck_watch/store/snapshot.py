"""The queue's snapshot: one status object for the stopped service and the running one.

`status` builds it from the registry on disk, the running service (the API, the page) from its
own scheduler, so the CLI, the page and scripts see the same shape. The worker sections are
what the service last recorded in the registry's meta table.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from stemdeck_watch.core.config import Folders, Settings
from stemdeck_watch.core.jobs import Job, JobKind
from stemdeck_watch.store.registry import REGISTRY_FILE, PendingMove, Registry

RECENT_JOBS = 50  # finished jobs a snapshot lists; older ones are paged (GET /api/jobs)


def build_snapshot(
    jobs: list[Job],
    order: list[str],
    waiting: list[tuple[str, JobKind, float]],
    pause_reason: str | None,
    folders: Folders,
    service: dict[str, Any],
    notes: list[str] | None = None,
    worker: dict[str, Any] | None = None,
    workers: list[dict[str, Any]] | None = None,
    older: int = 0,
    eta: dict[str, Any] | None = None,
    pending: list[PendingMove] | None = None,
) -> dict[str, Any]:
    """The `status --json` object: the queue, the service, its folders, and every worker
    (`workers`; `worker` is the first of them: its device, threads, model and precision with
    the figures that chose it).

    One builder for the stopped service (read from disk) and the running one (the API), so
    the CLI, the page and scripts see the same shape. `jobs` holds the jobs not finished and
    the most recent finished ones (`Registry.recent`); `older` finished jobs are left out,
    so a snapshot's size does not grow with the history.
    """
    by_id = {job.id: job for job in jobs}
    active = [job for job in jobs if job.state.is_running]  # newest first
    running = active[0] if active else None
    every = workers if workers is not None else ([worker] if worker else [])
    # a download recorded by a service that is not running any more is not going on
    download = (
        next((w["download"] for w in every if w.get("download")), None)
        if service.get("running")
        else None
    )
    return {
        "service": service,
        "paused": pause_reason is not None,
        "pause_reason": pause_reason,
        "running": running.to_status() if running else None,
        # every song being worked on now, oldest first: the one publishing behind the song
        # separating (queue.work_beside), one per worker with several workers
        "active": [job.to_status() for job in reversed(active)],
        "queued": [by_id[i].to_status() for i in order if i in by_id],
        "waiting": [{"source": s, "kind": k.value, "since": t} for s, k, t in waiting],
        "jobs": [job.to_status() for job in jobs],
        "older_jobs": older,
        "folders": {
            name: str(getattr(folders, name))
            for name in ("inbox", "outbox", "processed", "failed", "state")
        },
        "notes": notes or [],
        "worker": worker if worker is not None else (workers[0] if workers else None),
        # every worker (several with executor.kind = "ray"): where it runs, its device, the
        # job it holds
        "workers": every,
        # a model the worker downloads before it can separate (first use of a model):
        # {"model", "done", "total" (bytes; null: unknown), "text"}
        "download": {**download, "text": download_text(download)} if download else None,
        # when the songs left are expected to be done (engine/eta.py); null before any
        # estimate
        "eta": eta,
        # done or failed jobs whose input waits for its share to answer, to be moved into
        # processed/ (failed/): the input's final place is pending
        "pending_moves": [
            {"job": move.job_id, "source": move.source, "to": move.kind, "since": move.since}
            for move in pending or []
        ],
    }


def download_text(download: dict[str, Any]) -> str:
    """ "downloading htdemucs 34 / 80 MB": the one wording of status, the page and the tray."""
    done, total = download.get("done") or 0, download.get("total")
    amount = f"{_mb(done)} / {_mb(total)} MB" if total else f"{_mb(done)} MB"
    return f"downloading {download.get('model')} {amount}"


def _mb(size: int) -> str:
    megabytes = size / 1e6
    return f"{megabytes:.1f}" if megabytes < 10 else f"{megabytes:.0f}"


WORKERS_META = "workers"  # registry meta key: the executor records every worker's state there


def workers_of(registry: Registry) -> list[dict[str, Any]] | None:
    """Every worker as the service last recorded them (None before any model loaded, or if
    the record is torn)."""
    text = registry.get_meta(WORKERS_META)
    try:
        workers = json.loads(text) if text else None
    except ValueError:
        return None
    return workers if isinstance(workers, list) else None


def recorded_workers(settings: Settings) -> list[dict[str, Any]]:
    """The workers as the service last recorded them (doctor); [] before any was."""
    try:
        registry = Registry.open_readonly(settings.paths.state / REGISTRY_FILE)
        if registry is None:
            return []
        try:
            workers = workers_of(registry)
        finally:
            registry.close()
    except sqlite3.Error:  # no tables yet, locked, damaged: status says which
        return []
    return workers or []
