"""One job on its way through the pipeline: what each stage leaves for the next, its
progress on record and its stage timings (for the manifest)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.core.jobs import FileSignature, Job, JobState
from stemdeck_watch.engine.faults import Plan
from stemdeck_watch.engine.prepared import Prepared
from stemdeck_watch.links.fetch import Downloaded
from stemdeck_watch.stages.decode import DecodedAudio
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.separator import ModelInfo, Separation

PROGRESS_EVERY = 0.5  # seconds between progress writes to the registry


@dataclasses.dataclass
class StageTimer:
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def measure(self, stage: str, started: float) -> None:
        self.timings[stage] = round(time.monotonic() - started, 3)


@dataclasses.dataclass
class JobRun:
    """One job in the pipeline: what each stage leaves for the next."""

    job: Job  # as the stages have updated it (a link's title, the signature of what was read)
    control: JobControl
    report: Progress
    sep: SeparationSettings
    out: OutputSettings
    repo: str | None  # the model repo the settings name (None: demucs's own models)
    scratch: Path
    staging: Path
    source: Path  # the file to separate: the input, or a link's download
    # where each setting came from (config, preset, a tag in the name, a sidecar)
    origins: dict[str, str] = dataclasses.field(default_factory=dict)
    # the sha256 of the sidecar the choices were read from (None: none; "": it changed while
    # they were read, so which version was read is not known)
    sidecar: str | None = None
    # how this attempt separates: as configured, or smaller / on the CPU after memory faults
    plan: Plan = dataclasses.field(default_factory=Plan)
    timer: StageTimer = dataclasses.field(default_factory=StageTimer)
    start: float = 0.0  # where decoding starts on the progress bar (after a download)
    prepared: Prepared | None = None
    read: FileSignature | None = None  # the input's (a link's file's) when it was read
    link: Downloaded | None = None
    digest: str = ""
    size: int = 0
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    key: str = ""
    model: ModelInfo | None = None
    decoded: DecodedAudio | None = None
    separation: Separation | None = None
    # the end, once known: the song folder in the outbox (this job's, a copy's, a playlist's)
    # and a note for the job; `ended` with no output: a playlist link waits behind its entries
    ended: bool = False
    output: Path | None = None
    note: str | None = None
    marks_publishing: bool = True  # a playlist link's state is its entries': nothing to mark

    def end(self, output: Path | None = None, note: str | None = None) -> None:
        self.ended, self.output, self.note = True, output, note


class Progress:
    """Writes state changes at once and progress at most every PROGRESS_EVERY seconds."""

    def __init__(self, update: Callable[..., Job], job_id: str):
        self._update = update
        self._job_id = job_id
        self._last = 0.0

    def stage(self, state: JobState, progress: float, **fields: object) -> None:
        self._update(self._job_id, state=state, stage=state.value, progress=progress, **fields)
        self._last = time.monotonic()

    def progress(self, value: float) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY:
            self._last = now
            self._update(self._job_id, progress=value)
