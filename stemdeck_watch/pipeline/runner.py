"""One job through its stages: decode → separate → publish → move the input.

The pipeline lock is the second guard of "one job at a time": the queue's single consumer is
the normal path, and the lock holds for any path that bypasses it (tests, re-runs). Between
stages the job's cancel flag is checked; during the long steps the step itself is registered
so a cancel stops it at once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Callable, Optional

from stemdeck_watch.config import Settings
from stemdeck_watch.errors import Cancelled, DecodeError, FilesystemError
from stemdeck_watch.events import EventBus, JobSeparated
from stemdeck_watch.jobqueue import JobControl
from stemdeck_watch.intake.links import read_link
from stemdeck_watch.jobs import FileSignature, Job, JobKind, JobState, settings_key_of
from stemdeck_watch.paths import find_moved, move_file
from stemdeck_watch.pipeline import publish
from stemdeck_watch.pipeline.decode import decode_to_file
from stemdeck_watch.pipeline.fetch import Downloaded, download
from stemdeck_watch.pipeline.separate import WorkerClient

log = logging.getLogger(__name__)

# Share of the job's progress bar each stage fills (a link's download takes its share from
# the separation's, so the bar only ever moves forward).
DOWNLOAD_SHARE, DECODE_SHARE, SEPARATE_SHARE = 0.15, 0.05, 0.90
PROGRESS_EVERY = 0.5  # seconds between progress writes to the registry


Claim = Callable[[Callable[[float], None]], Optional[Downloaded]]


@dataclasses.dataclass
class StageTimer:
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def measure(self, stage: str, started: float) -> None:
        self.timings[stage] = round(time.monotonic() - started, 3)


class Pipeline:
    def __init__(self, settings: Settings, client: WorkerClient, bus: EventBus,
                 update: Callable[..., Job],
                 published: Callable[[str, str], list[str]] = lambda _sha, _key: []):
        self.settings = settings
        self.client = client
        self.bus = bus
        self._update = update
        self._published = published  # outbox folders of done jobs with this content + settings
        self._lock = threading.Lock()

    def prepare(self, job: Job, control: JobControl,
                on_progress: Callable[[float], None]) -> Downloaded | None:
        """What a job needs before the worker: for a link, its download (into the job's
        scratch folder). Safe to run ahead, off the pipeline lock, while another job holds the
        worker: it touches neither the worker nor the outbox."""
        if job.kind is not JobKind.LINK:
            return None
        link = Path(job.source)
        url = read_link(link)
        return download(url, self.settings.paths.scratch / job.id / "download",
                        self.settings.links, check=control.check, on_progress=on_progress,
                        link_name=link.name)

    def run(self, job: Job, control: JobControl, claim: Claim | None = None) -> Job:
        """Run every stage; returns the finished job. Raises StageError or Cancelled.
        `claim` hands over what `prepare` made (or is making) ahead of time for this job,
        reporting its progress from now on; None from it means nothing was prepared."""
        with self._lock:
            folders = self.settings.paths
            scratch = folders.scratch / job.id
            staging = folders.staging / job.id
            try:
                output, note = self._run(job, control, scratch, staging, claim)
            finally:
                publish.remove_tree(scratch)
                publish.remove_tree(staging)
                publish.remove_if_empty(folders.staging)
            # announced as done only once the hidden staging folder is gone too
            return self.finish_published(job, Path(job.source), output, note)

    def _run(self, job: Job, control: JobControl, scratch: Path, staging: Path,
             claim: Claim | None) -> tuple[Path, str | None]:
        """Download (links), decode, separate and publish; returns the published folder (or
        the existing one of a duplicate) and a note for the job."""
        sep, out = self.settings.for_preset(job.preset)
        repo = self.settings.resolve_model_repo(sep)
        source = Path(job.source)
        report = _Progress(self._update, job.id)
        timer = StageTimer()
        start = 0.0  # where decoding starts on the progress bar (after a download)

        link: Downloaded | None = None
        if job.kind is JobKind.LINK:
            start = DOWNLOAD_SHARE
            report.stage(JobState.DOWNLOADING, 0.0)
            started = time.monotonic()
            progress = lambda v: report.progress(DOWNLOAD_SHARE * v)  # noqa: E731
            link = (claim(progress) if claim else None) or self.prepare(job, control, progress)
            timer.measure("download", started)
            control.check()
            job = self._update(job.id, name=link.title)  # the song is named by its title
            source = link.path

        report.stage(JobState.DECODING, start)
        try:
            digest, size = publish.sha256_of(source), source.stat().st_size
        except OSError as exc:
            control.check()  # taken away while we read it: a cancel, not a failure
            raise DecodeError(str(FilesystemError("read", source, reason=exc))) from exc
        settings = {"separation": dataclasses.asdict(sep), "output": dataclasses.asdict(out)}
        key = settings_key_of(settings) or ""
        copy = self._duplicate_of(digest, key)
        if copy is not None:
            log.info("%s was separated before with the same settings: the stems are in %s",
                     Path(job.source).name, copy)
            return copy, f"already separated with the same settings: the stems are in {copy}"
        self._update(job.id, sha256=digest, settings_key=key)
        started = time.monotonic()
        model = self.client.ensure_model(sep.model, str(repo) if repo else None, control)
        timer.measure("model", started)
        started = time.monotonic()
        decoded = decode_to_file(source, scratch / "input.npy", model.samplerate,
                                 model.audio_channels, control.check,
                                 lambda v: report.progress(start + DECODE_SHARE * v))
        timer.measure("decode", started)
        control.check()

        separate_share = SEPARATE_SHARE - start
        report.stage(JobState.SEPARATING, start + DECODE_SHARE)
        result = self.client.separate(
            job.id, sep.model, str(repo) if repo else None, decoded.path, scratch / "stems",
            shifts=sep.shifts, overlap=sep.overlap, segment=sep.segment or None,
            control=control, stats=decoded.stats,
            on_progress=lambda v: report.progress(start + DECODE_SHARE + separate_share * v))
        timer.timings["separate"] = round(result.seconds, 3)
        self.bus.publish(JobSeparated(job.id, result.worker_pid, result.seconds))
        control.check()

        report.stage(JobState.PUBLISHING, DECODE_SHARE + SEPARATE_SHARE)
        started = time.monotonic()
        entries = publish.write_song(staging, result.stems, model.samplerate, job.name, sep, out)
        timer.measure("write", started)
        publish.write_manifest(staging, {
            "job_id": job.id,
            "input": {"name": Path(job.source).name, "rel_path": job.rel_path,
                      "sha256": digest, "size": size,
                      "codec": decoded.source_codec, "samplerate": decoded.source_samplerate,
                      "channels": decoded.source_channels,
                      "duration": round(decoded.seconds, 6)},
            "model": {"name": sep.model, "repo": str(repo) if repo else None,
                      "samplerate": model.samplerate, "sources": list(model.sources)},
            "preset": job.preset,
            **({"link": link.manifest()} if link else {}),
            "settings": settings,
            "stems": entries,
            "timings": timer.timings,
            "versions": self.client.versions,
        })
        if not control.commit():  # last chance for a cancel: after this the song is out
            raise Cancelled(control.reason or "cancelled")
        rel = PurePosixPath(job.rel_path)
        target = self.settings.paths.outbox.joinpath(*rel.parent.parts, job.name)
        output = publish.publish_folder(staging, target)
        log.info("published %s → %s (decode %.1f s, separate %.1f s, write %.1f s)",
                 source.name, output, timer.timings["decode"], timer.timings["separate"],
                 timer.timings["write"])
        return output, None

    def _duplicate_of(self, digest: str, key: str) -> Path | None:
        """A complete outbox folder of a done job with the same content and settings, if
        duplicates are skipped (`queue.on_duplicate`)."""
        if self.settings.queue.on_duplicate != "skip":
            return None
        for folder in self._published(digest, key):
            if publish.read_manifest(Path(folder)) is not None:
                return Path(folder)
        return None

    def finish_published(self, job: Job, source: Path, output: Path,
                         note: str | None = None) -> Job:
        """Move the input to processed/ — only now that its stems are safely published."""
        error = note
        moved_to = source
        try:
            current = FileSignature.of(os.stat(source))
        except OSError:
            current = None
        target = self.settings.paths.processed / PurePosixPath(job.rel_path)
        if current is None:
            # gone: taken away, or moved here just before a crash cut off the registry write
            sig = job.signature
            moved = find_moved(target, sig.size, sig.mtime_ns) if sig else None
            moved_to = moved or source
            log.info("%s is no longer in the inbox; %s", source,
                     f"it is at {moved}" if moved else "nothing to move")
        elif job.signature is not None and current != job.signature:
            error = (f"stems published, but {source} changed while it was separated, so it "
                     f"stays in the inbox and will be separated again")
            log.warning("%s", error)
        else:
            try:
                moved_to = move_file(source, target)
            except FilesystemError as exc:
                error = f"stems published, but {exc}; the input stays in the inbox"
                log.error("%s", error)
        return self._update(job.id, state=JobState.DONE, progress=1.0, output=str(output),
                            source=str(moved_to), error=error, stage=None,
                            finished_at=time.time())


class _Progress:
    """Writes state changes at once and progress at most every PROGRESS_EVERY seconds."""

    def __init__(self, update: Callable[..., Job], job_id: str):
        self._update = update
        self._job_id = job_id
        self._last = 0.0

    def stage(self, state: JobState, progress: float) -> None:
        self._update(self._job_id, state=state, stage=state.value, progress=progress)
        self._last = time.monotonic()

    def progress(self, value: float) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY:
            self._last = now
            self._update(self._job_id, progress=value)
