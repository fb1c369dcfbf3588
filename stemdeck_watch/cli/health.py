"""`health`: exit 0 while the service runs and its queue moves, 1 otherwise — the command a
container runtime's health check (or a monitoring script) runs.

"Runs" is three things: the service holds its lock, its local API answers (when it is on), and
no song has sat in a running state without any change for longer than `--stall` seconds. The
worker's own stall limit (`separation.stall_seconds`) already stops a worker that goes quiet
mid-song and tries the song again, so a song that stays put here is one the service itself
is stuck under — what a restart is for. A model download in progress and a share that is away
(the queue paused for `inbox` or `outbox`) are waits the service knows about: not stuck.

Everything is read from disk or asked of the API with a deadline, so the check answers within
the runtime's health-check timeout even when the service hangs.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from typing import Any, Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import StemdeckError
from stemdeck_watch.core.lock import running_pid

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1
DEFAULT_STALL = 1800.0  # seconds a running song may go without any recorded change
SHARE_WAITS = ("inbox", "outbox")  # pause reasons under which a song waits by design


def add_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    health = add(
        "health",
        help="exit 0 while the service runs and its queue moves, 1 otherwise (health checks)",
    )
    health.add_argument(
        "--stall",
        type=float,
        default=DEFAULT_STALL,
        metavar="SECONDS",
        help=f"a song running this long without a change is stuck (default {DEFAULT_STALL:.0f})",
    )


def problems(
    settings: Settings,
    stall: float,
    now: Callable[[], float] = time.time,
    ask_api: Callable[[Settings], None] | None = None,
) -> list[str]:
    """What is wrong, as a person reads it; [] while healthy. `ask_api` asks the running
    service's API for its queue (raising StemdeckError when it does not answer); tests pass
    their own."""
    state = settings.paths.state
    pid = running_pid(state)
    if pid is None:
        return [f"the service is not running (state folder {state})"]
    found: list[str] = []
    if settings.api.enabled:
        try:
            (ask_api or _ask_api)(settings)
        except StemdeckError as exc:
            found.append(f"the service (pid {pid}) does not answer: {exc}")
    try:
        found += _stuck(settings, stall, now())
    except sqlite3.Error as exc:
        found.append(f"could not read the job registry: {exc}")
    return found


def _ask_api(settings: Settings) -> None:
    from stemdeck_watch.ui.web.client import Client

    Client.connect(settings.paths.state).get("/api/queue")


def _stuck(settings: Settings, stall: float, now: float) -> list[str]:
    # imported here: the parser is built for every command, the registry read only for this one
    from stemdeck_watch.core.jobs import RUNNING_STATES
    from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
    from stemdeck_watch.store.snapshot import workers_of
    from stemdeck_watch.util.safetext import escape_controls

    registry = Registry.open_readonly(settings.paths.state / REGISTRY_FILE)
    if registry is None:
        return []
    try:
        try:
            running = registry.jobs(states=RUNNING_STATES)
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # a registry the service has only just made
                return []
            raise
        if not running:
            return []
        if registry.get_meta("pause_reason") in SHARE_WAITS:
            return []
        workers: list[dict[str, Any]] = workers_of(registry) or []
    finally:
        registry.close()
    if any(worker.get("download") for worker in workers):
        return []
    return [
        f"{escape_controls(job.name)} (job {job.id}) has been {job.state.value} for "
        f"{now - job.updated_at:.0f} s without a change (limit {stall:.0f} s): the queue is stuck"
        for job in running
        if now - job.updated_at > stall
    ]


def run(args: argparse.Namespace, settings: Settings) -> int:
    found = problems(settings, args.stall)
    if found:
        for line in found:
            print(f"unhealthy: {line}", file=sys.stderr)
        return EXIT_UNHEALTHY
    print(f"healthy: the service runs (pid {running_pid(settings.paths.state)})")
    return EXIT_HEALTHY
