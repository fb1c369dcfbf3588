"""Helpers the tests share: waiting on conditions, settings and config files on temporary
folders, a scheduler on disk, a log of job events, a gate that holds a separation back,
the process table."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stemdeck_watch.core.config import Settings, default_toml
from stemdeck_watch.ui.folder import STATUS_FILE, is_status_temp
from stemdeck_watch.core.events import EventBus, JobChanged
from stemdeck_watch.store.jobqueue import JobControl, JobQueue
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState
from stemdeck_watch.engine.pipeline import Pipeline
from stemdeck_watch.workers.local import WorkerClient
from stemdeck_watch.workers.separator import Separation
from stemdeck_watch.engine.recovery import restore
from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
from stemdeck_watch.engine.scheduler import Scheduler


REPO = Path(__file__).resolve().parents[2]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 60.0,
    what: str | Callable[[], str] = "condition",
    interval: float = 0.05,
) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds.
    `what` may be a callable, so the failure can say what was seen instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {said}")
        time.sleep(interval)


def outbox_entries(outbox: Path) -> set[str]:
    """What the outbox holds besides the service's own STATUS.txt (and its hidden temporary
    copy while it is rewritten, a moment at a time): song folders, and any hidden leftovers
    (which must not be there)."""
    return {
        p.name for p in outbox.iterdir() if p.name != STATUS_FILE and not is_status_temp(p.name)
    }


def on_worker_side(states: dict[str, JobState]) -> list[str]:
    """The jobs taken and not yet publishing (one publishes behind the next one's
    separation): more than one is two songs shown separating at once."""
    return [
        job_id
        for job_id, state in states.items()
        if state.is_running and state is not JobState.PUBLISHING
    ]


class SeparationGate:
    """Holds the real worker back from separating one job until `open()`: "X happened while
    that job separated" then follows from the order of events, not from how fast this
    machine separates. The job stays in its separating state meanwhile; a cancel still ends
    it, as the worker's would."""

    def __init__(self, client: WorkerClient, job_id: str) -> None:
        self._opened = threading.Event()
        real = client.separate

        def gated(sep_job_id: str, *args: Any, **kwargs: Any) -> Any:
            if sep_job_id == job_id:
                while not self._opened.wait(0.05):
                    kwargs["control"].check()
            return real(sep_job_id, *args, **kwargs)

        client.separate = gated  # type: ignore[method-assign]

    def open(self) -> None:
        self._opened.set()


def processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, state letter) (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this test process (Linux /proc)."""
    me = os.getpid()
    return {pid for pid, (parent, state) in processes().items() if parent == me and state != "Z"}


def write_paced(path: Path, chunks: list[bytes], interval: float, reopen: bool) -> None:
    """Write `chunks` into `path` on a fixed schedule (chunk i at i × interval): a slow copy.
    `reopen` opens and closes the file for every chunk, as some sync clients do."""
    pace = threading.Event()  # never set: waiting on it keeps the schedule
    start = time.monotonic()
    handle = None if reopen else open(path, "wb")
    try:
        for i, chunk in enumerate(chunks):
            pace.wait(max(0.0, start + i * interval - time.monotonic()))
            if reopen:
                with open(path, "ab") as each:
                    each.write(chunk)
            else:
                handle.write(chunk)
                handle.flush()
    finally:
        if handle is not None:
            handle.close()


def config_data(folder: Path, model_repo: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A complete config on folders under `folder` with the tiny model; keyword args
    override sections, e.g. config_data(tmp, repo, watch={"settle_seconds": 1.0})."""
    data = default_toml()
    data["folders"] = {
        name: str(folder / name) for name in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"].update(model="tiny", model_repo=str(model_repo), device="cpu")
    data["watch"]["settle_seconds"] = 0.3
    data["notify"]["urls"] = []  # no desktop notifications from the tests (they set their own)
    # the beat grid loads librosa (3-9 s per service process on 2 cores): tests of it turn it
    # on (tests/test_output_*.py); the rest keep the suite fast
    data["output"]["beat_grid"] = False
    # the tests' media servers listen on 127.0.0.1, which links refuse by default
    data["links"]["allow_private"] = True
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def write_config(folder: Path, model_repo: Path, **sections: dict[str, Any]) -> Path:
    """The same config as a `stemdeck.toml` file, for tests that drive the CLI."""
    import tomli_w

    path = folder / "stemdeck.toml"
    path.write_text(tomli_w.dumps(config_data(folder, model_repo, **sections)))
    return path


class JobLog:
    """Collects every job change the service announces."""

    def __init__(self, bus: EventBus):
        self._lock = threading.Lock()
        self.latest: dict[str, Job] = {}
        bus.subscribe(JobChanged, self._on_change)

    def _on_change(self, event: JobChanged) -> None:
        with self._lock:
            self.latest[event.job.id] = event.job

    def final(self) -> list[Job]:
        with self._lock:
            return [job for job in self.latest.values() if job.state.is_final]

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self.latest.values())

    def wait_final(self, count: int, timeout: float = 120.0) -> list[Job]:
        return wait_for(
            lambda: len(self.final()) >= count and self.final(),
            timeout,
            f"{count} job(s) to finish",
        )


def open_scheduler(settings: Settings) -> Scheduler:
    registry = Registry.open(settings.paths.state / REGISTRY_FILE)
    return Scheduler(registry, JobQueue(), EventBus(), settings)


def add_job(
    scheduler: Scheduler, settings: Settings, name: str, state: JobState, attempts: int = 0
) -> Job:
    """A job as a previous run left it, with a (fake) input file in the inbox."""
    source = settings.paths.inbox / f"{name}.wav"
    source.write_bytes(b"RIFF....WAVE")
    sig = FileSignature.of(source.stat())
    return scheduler.registry.add(
        Job(
            id=f"job-{name}",
            name=name,
            kind=JobKind.FILE,
            state=state,
            source=str(source),
            rel_path=f"{name}.wav",
            signature=sig,
            attempts=attempts,
        )
    )


def run_restore(settings: Settings) -> tuple[Scheduler, int]:
    scheduler = open_scheduler(settings)
    pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
    return scheduler, restore(scheduler, settings, pipeline.file_input)


def noise_mix(folder: Path, seconds: float) -> Path:
    """`seconds` of stereo noise as the decoded song a worker separates (`mix.npy`)."""
    path = folder / "mix.npy"
    rng = np.random.default_rng(0)
    np.save(path, (0.1 * rng.standard_normal((2, int(seconds * 44100)))).astype(np.float32))
    return path


def separate_tiny(
    client: WorkerClient,
    model_repo: Path,
    source: Path,
    out: Path,
    control: JobControl,
    progress: list[float] | None = None,
) -> Separation:
    """The tiny model's separation of `source` into `out` through `client`."""
    return client.separate(
        "job",
        "tiny",
        str(model_repo),
        source,
        out,
        control=control,
        on_progress=(progress.append if progress is not None else lambda v: None),
    )
