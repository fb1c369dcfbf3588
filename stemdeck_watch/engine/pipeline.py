"""One job through its stages: decode → separate → publish → move the input.

The pipeline lock is the second guard of "one job at a time": the queue's single consumer is
the normal path, and the lock holds for any path that bypasses it (tests, re-runs). Between
stages the job's cancel flag is checked; during the long steps the step itself is registered
so a cancel stops it at once.

The worker is the scarce part, so the steps around it run beside it: `prepare` (a link's
download, and the decode and hash of the next file) runs ahead, off the lock, driven by the
Prefetcher; `start` holds the lock only up to the end of separation and hands back the
publish step, which the dispatcher runs behind the next job's separation (`run` does both in
turn). Decoded-ahead audio is used only if it was decoded from the same file (size, mtime,
inode and change time unchanged: `cp -p` onto the file keeps the first three) for the same
model rate and channels, and a download only if the link file still holds the URL it was made
from; otherwise the job decodes or downloads again.

A job is queued with its input's signature, but the file may be replaced before the job
reads it: the job takes the signature of the version it actually read, so the check after
publishing ("changed while it was separated") compares against what was separated.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Optional

from stemdeck_watch.core import choices
from stemdeck_watch.core.config import Folders, OutputSettings, SeparationSettings, Settings
from stemdeck_watch.core.errors import Cancelled, DecodeError, FilesystemError
from stemdeck_watch.core.events import EventBus, JobSeparated
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.links.linkfile import LinkError, read_link
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState, settings_key_of
from stemdeck_watch.core.paths import find_moved, move_file
from stemdeck_watch.stages import publish, songfolder
from stemdeck_watch.stages.decode import DecodedAudio, decode_to_file
from stemdeck_watch.links.fetch import Downloaded, Playlist, download
from stemdeck_watch.engine.inflight import SongsInFlight
from stemdeck_watch.workers.local import ModelInfo, Separation, WorkerClient
from stemdeck_watch.engine.playlists import Playlists

if TYPE_CHECKING:
    from stemdeck_watch.engine.diskguard import DiskGuard

log = logging.getLogger(__name__)

# Share of the job's progress bar each stage fills (a link's download takes its share from
# the separation's, so the bar only ever moves forward).
DOWNLOAD_SHARE, DECODE_SHARE, SEPARATE_SHARE = 0.15, 0.05, 0.90
PROGRESS_EVERY = 0.5  # seconds between progress writes to the registry

Version = tuple[FileSignature, int]  # a file's signature and its change time (st_ctime_ns)


@dataclasses.dataclass
class Prepared:
    """What `prepare` made ahead of the worker for one job (in its scratch folder)."""

    download: Downloaded | None = None
    playlist: Playlist | None = None  # a playlist link's entries, listed (links.playlists)
    # a link job: the link file's signature and its URL when it was read; the download (or
    # listing) is the job's only while the link file is still exactly that
    link: FileSignature | None = None
    url: str | None = None
    decoded: DecodedAudio | None = None
    sha256: str | None = None
    # the input's version when it was hashed and decoded, and the model rate and channels
    # it was decoded for: the decode is used only if all still hold
    version: Version | None = None
    format: tuple[int, int] | None = None

    def made_from(self, link: Path) -> bool:
        """Whether the download or listing was made from `link` as it is now."""
        if self.link is None or _signature(link) != self.link:
            return False
        try:
            return read_link(link) == self.url
        except LinkError:
            return False

    def decoded_for(self, source: Path, samplerate: int, channels: int) -> DecodedAudio | None:
        """The decoded audio if it is still the input's, at this rate and channel count."""
        if self.decoded is None or self.format != (samplerate, channels):
            return None
        if _version(source) != self.version or not self.decoded.path.exists():
            return None
        return self.decoded

    def sha256_for(self, source: Path) -> str | None:
        return self.sha256 if self.sha256 and _version(source) == self.version else None


def _signature(path: Path) -> FileSignature | None:
    try:
        return FileSignature.of(path.stat())
    except OSError:
        return None


def _version(path: Path) -> Version | None:
    """The file's signature and change time: a write into the same file that sets the old
    size and modification time back (`cp -p` onto it) still moves the change time."""
    try:
        st = path.stat()
    except OSError:
        return None
    return FileSignature.of(st), st.st_ctime_ns


Claim = Callable[[Callable[[float], None]], Optional[Prepared]]
Written = Optional[tuple[Path, Optional[str]]]  # the published folder and a note, or None


@dataclasses.dataclass(frozen=True)
class PublishStep:
    """The rest of a job once the worker is done with it.

    `begin` marks the job publishing. The dispatcher calls it on its own thread before it
    takes the next job, so nobody (status, the page, the tray) ever sees a song still
    separating beside the next one; `rest` writes and publishes, behind the worker or not.
    Calling the step runs both."""

    begin: Callable[[], None]
    rest: Callable[[], Job]

    def __call__(self) -> Job:
        self.begin()
        return self.rest()


@dataclasses.dataclass
class StageTimer:
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def measure(self, stage: str, started: float) -> None:
        self.timings[stage] = round(time.monotonic() - started, 3)


class Pipeline:
    def __init__(self, settings: Settings, client: WorkerClient, bus: EventBus,
                 update: Callable[..., Job],
                 published: Callable[[str, str], list[str]] = lambda _sha, _key: [],
                 songs: SongsInFlight | None = None):
        self.settings = settings
        self.client = client
        self.bus = bus
        self._update = update
        self._published = published  # outbox folders of done jobs with this content + settings
        self._songs = songs or SongsInFlight()  # shared by the pipelines of every worker
        self._lock = threading.Lock()
        self.playlists: Playlists | None = None  # set by the service (links.playlists)
        # set by the service: a link is checked for room again once its download says its
        # length, and decoded ahead only if it fits
        self.disk: DiskGuard | None = None

    def works_beside(self, job: Job) -> bool:
        """Whether to publish `job` behind the worker, or decode it ahead of it
        (`queue.work_beside`).

        "auto" does so where the worker leaves room (a GPU, or a core it does not use), and
        on a CPU the worker fills as long as `job` has no beat grid: there, beside the
        worker, the ten-clip run took 0.90x as long as serially; with the beat grid (and
        preview, tags) on it took 1.01x-1.18x as long, stretching separation 1.3x-1.6x, so
        the worker keeps the cores (README, Benchmarks → Work beside the worker)."""
        mode = self.settings.queue.work_beside
        if mode != "auto":
            return mode == "on"
        _separation, output = self._settings_of(job)
        return self.client.leaves_room() or not songfolder.needs_beat_grid(output)

    def can_prepare(self, job: Job) -> bool:
        """Whether `prepare` has anything to do ahead for `job`: a link's download (it waits
        on the network, not the CPU), or a file's decode when work beside the worker pays
        and the worker holds the job's model already (decoding needs the model's rate and
        channels, and the worker is busy: no loading ahead)."""
        return job.kind is JobKind.LINK or (self.works_beside(job)
                                            and self._loaded_format(job) is not None)

    def _settings_of(self, job: Job) -> tuple[SeparationSettings, OutputSettings]:
        """The job's settings with its choices (preset, name tags, sidecar), for deciding
        what to do ahead; choices that cannot be used fail the job when it runs."""
        try:
            chosen = choices.for_job(self.settings, job)
        except choices.ChoiceError:
            return self.settings.for_preset(job.preset)
        return chosen.separation, chosen.output

    def _loaded_format(self, job: Job) -> tuple[int, int] | None:
        sep, _ = self._settings_of(job)
        repo = self.settings.resolve_model_repo(sep)
        model = self.client.model_info
        if model is None or (model.name, model.repo) != (sep.model, str(repo) if repo else None):
            return None
        return model.samplerate, model.audio_channels

    def prepare(self, job: Job, control: JobControl,
                on_progress: Callable[[float], None], decode: bool = True) -> Prepared:
        """What a job needs before the worker, into the job's scratch folder: a link's
        download, then (`decode`, when the worker holds the job's model) the input's hash
        and decode. Safe to run ahead, off the pipeline lock, while another job holds the
        worker: it touches neither the worker nor the outbox."""
        prepared = Prepared()
        source = Path(job.source)
        if job.kind is JobKind.LINK:
            if self.playlists is not None and self.playlists.expanded(job):
                return prepared  # a playlist link's last step: nothing to fetch
            link = Path(job.source)
            prepared.link = _signature(link)  # before reading: a later edit shows as a change
            prepared.url = url = read_link(link)
            entry = job.playlist  # an entry of a playlist: its title and length are known
            got = download(url, self.settings.paths.scratch / job.id / "download",
                           self.settings.links, control=control, on_progress=on_progress,
                           link_name=link.name, playlist=entry,
                           title=job.name if entry else None,
                           expand=(self.playlists is not None and entry is None
                                   and self.settings.links.playlists))
            if isinstance(got, Playlist):
                prepared.playlist = got
                return prepared
            prepared.download = got
            source = got.path
            if self.disk is not None:
                self.disk.learn_download(job, got.path)
        form = self._loaded_format(job) if decode else None
        if form is None or (job.kind is JobKind.LINK and self.disk is not None
                            and not self.disk.fits_ahead(job)):
            return prepared
        version = _version(source)
        try:
            digest = publish.sha256_of(source)
            decoded = decode_to_file(source, self.settings.paths.scratch / job.id / "input.npy",
                                     form[0], form[1], control.check)
        except Cancelled:
            raise
        except Exception as exc:  # the job decodes again when it runs, and fails with the reason
            log.info("could not decode %s ahead (%s); it is decoded when it runs", source, exc)
            return prepared
        if _version(source) == version:  # not changed while we read it
            prepared.sha256, prepared.decoded = digest, decoded
            prepared.version, prepared.format = version, form
        return prepared

    def run(self, job: Job, control: JobControl, claim: Claim | None = None) -> Job:
        """Run every stage; returns the finished job. Raises StageError or Cancelled.
        `claim` hands over what `prepare` made (or is making) ahead of time for this job,
        reporting its progress from now on; None from it means nothing was prepared."""
        return self.start(job, control, claim)()

    def start(self, job: Job, control: JobControl, claim: Claim | None = None) -> PublishStep:
        """Every stage up to the end of separation, under the pipeline lock; returns the
        publish step (write, manifest, publish, move the input), which needs no worker and
        may run while the next job separates. Raises StageError or Cancelled (scratch and
        staging removed); so does the publish step."""
        folders = self.settings.paths
        scratch = folders.scratch / job.id
        staging = folders.staging / job.id

        def cleaned_on_error(work: Callable[[], Any]) -> Any:
            try:
                return work()
            except BaseException:
                _clean(folders, scratch, staging)
                self._songs.release(job.id)
                raise

        with self._lock:
            enter, write, as_read = cleaned_on_error(
                lambda: self._run(job, control, scratch, staging, claim))

        def rest() -> Job:
            try:
                ran = write()
            finally:
                _clean(folders, scratch, staging)
            if ran is None:  # a playlist link: its entries are queued, it waits behind them
                return job
            # announced as done only once the hidden staging folder is gone too; checked
            # against the version of the input that was read
            return self.finish_published(as_read, Path(job.source), *ran)

        def rest_then_release() -> Job:
            try:
                return rest()
            finally:  # done (or failed) on record: a job waiting for this song looks again
                self._songs.release(job.id)

        return PublishStep(lambda: cleaned_on_error(enter), rest_then_release)

    def _run(self, job: Job, control: JobControl, scratch: Path, staging: Path,
             claim: Claim | None) -> tuple[Callable[[], None], Callable[[], Written], Job]:
        """Download (links), decode and separate; returns the start of the publish step (it
        marks the job publishing), the rest, which returns the published folder (or the
        existing one of a duplicate) and a note for the job, or None for a playlist link that
        queued its entries or waits for them, and the job with the signature of the input
        (the link file, for a link) as it was read."""
        chosen = choices.for_job(self.settings, job)  # a bad tag or sidecar fails it now
        sep, out = chosen.separation, chosen.output
        repo = self.settings.resolve_model_repo(sep)
        source = Path(job.source)
        report = _Progress(self._update, job.id)
        timer = StageTimer()

        def enter() -> None:
            # behind the worker, publishing starts once the previous song's publish has
            # ended (one song publishes at a time)
            control.check()
            report.stage(JobState.PUBLISHING, DECODE_SHARE + SEPARATE_SHARE)

        start = 0.0  # where decoding starts on the progress bar (after a download)

        link: Downloaded | None = None
        prepared: Prepared | None = None
        read: FileSignature | None = None  # the input's (a link's file's) when it was read
        if job.kind is JobKind.LINK:
            if self.playlists is not None and self.playlists.expanded(job):
                settled = self.playlists.settle(job, control)  # the playlist's last step
                if settled is not None and not control.commit():
                    raise Cancelled(control.reason or "cancelled")
                return _nothing, lambda: settled, job
            start = DOWNLOAD_SHARE
            report.stage(JobState.DOWNLOADING, 0.0)
            started = time.monotonic()
            progress = lambda v: report.progress(DOWNLOAD_SHARE * v)  # noqa: E731
            prepared = claim(progress) if claim else None
            if prepared is not None and not prepared.made_from(source):
                if prepared.link is not None:
                    log.info("%s changed after its download was prepared; fetching what it "
                             "says now", source.name)
                publish.remove_tree(scratch)  # none of it is this link's
                prepared = None
            if prepared is None:
                prepared = self.prepare(job, control, progress, decode=False)
            read = prepared.link
            if prepared.playlist is not None:
                assert self.playlists is not None  # only then are playlists listed
                self.playlists.expand(job, prepared.playlist, control)
                return _nothing, lambda: None, job
            link = prepared.download
            assert link is not None
            timer.measure("download", started)
            control.check()
            if self.disk is not None:  # its length is known now: does all of it fit?
                self.disk.admit_download(job, link.path)
            job = self._update(job.id, name=link.title)  # the song is named by its title
            source = link.path

        report.stage(JobState.DECODING, start)
        if prepared is None and claim is not None:
            prepared = claim(lambda _v: None)  # a decode ahead in flight is waited for
        if link is None:
            read = _signature(source)  # looked at before it is read: a later change shows
        job = dataclasses.replace(job, signature=read or job.signature)
        try:
            digest = (prepared and prepared.sha256_for(source)) or publish.sha256_of(source)
            size = source.stat().st_size
        except OSError as exc:
            control.check()  # taken away while we read it: a cancel, not a failure
            raise DecodeError(str(FilesystemError("read", source, reason=exc))) from exc
        settings = {"separation": dataclasses.asdict(sep), "output": dataclasses.asdict(out)}
        key = settings_key_of(settings) or ""
        copy = self._duplicate_of(job, digest, key, control)
        if copy is not None:
            log.info("%s was separated before with the same settings: the stems are in %s",
                     Path(job.source).name, copy)
            note = f"already separated with the same settings: the stems are in {copy}"
            return enter, lambda: (copy, note), job
        started = time.monotonic()
        model = self.client.ensure_model(sep.model, str(repo) if repo else None, control,
                                         precision=sep.precision)
        timer.measure("model", started)
        started = time.monotonic()
        decoded = prepared.decoded_for(source, model.samplerate,
                                       model.audio_channels) if prepared else None
        if decoded is None:
            decoded = decode_to_file(source, scratch / "input.npy", model.samplerate,
                                     model.audio_channels, control.check,
                                     lambda v: report.progress(start + DECODE_SHARE * v))
        timer.measure("decode", started)
        control.check()

        separate_share = SEPARATE_SHARE - start
        # one registry write (a sync to disk) for both: between two jobs it is worker idle time
        report.stage(JobState.SEPARATING, start + DECODE_SHARE, sha256=digest, settings_key=key,
                     signature=job.signature)
        result = self.client.separate(
            job.id, sep.model, str(repo) if repo else None, decoded.path, scratch / "stems",
            shifts=sep.shifts, overlap=sep.overlap, segment=sep.segment or None,
            control=control, stats=decoded.stats, precision=model.dtype,
            on_progress=lambda v: report.progress(start + DECODE_SHARE + separate_share * v))
        timer.timings["separate"] = round(result.seconds, 3)
        self.bus.publish(JobSeparated(job.id, result.worker_pid, result.seconds))
        control.check()

        return enter, lambda: self._publish(job, control, staging, source, result, model,
                                            decoded, digest, size, sep, out, settings, link,
                                            timer, chosen.origins), job

    def _publish(self, job: Job, control: JobControl, staging: Path, source: Path,
                 result: Separation, model: ModelInfo, decoded: DecodedAudio, digest: str,
                 size: int, sep: SeparationSettings, out: OutputSettings,
                 settings: dict[str, Any], link: Downloaded | None,
                 timer: StageTimer, origins: dict[str, str]) -> tuple[Path, str | None]:
        """Write the stems and the manifest into staging and publish them; returns the
        published folder. Needs no worker: it may run while the next job separates."""
        repo = model.repo
        control.check()
        # issue #9: stems at output.samplerate, tags, beats.json, preview.png (timed each)
        info = songfolder.song_info(job.name, job.preset, decoded)
        song = songfolder.make_song_folder(staging, result.stems, model.samplerate, info, sep,
                                           out, check=control.check)
        timer.timings.update(song.timings)
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
            # where each setting came from: config, preset, a tag in the name, a sidecar
            "settings_from": origins,
            "stems": song.entries,
            **song.manifest,
            "timings": timer.timings,
            "versions": self.client.versions,
            # issue #13: the precision the worker separated in, and the figures that chose it
            "precision": dict(model.precision) or {"precision": model.dtype},
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

    def _duplicate_of(self, job: Job, digest: str, key: str,
                      control: JobControl) -> Path | None:
        """A complete outbox folder holding this content separated with these settings, by
        its manifest, if duplicates are skipped (`queue.on_duplicate`). The folder a done
        job published may hold another song by now (moved away, another published there).

        A job with the same song in flight is waited for: its end decides. Otherwise this
        job holds the song until it ends (SongsInFlight), so a copy behind it waits."""
        if self.settings.queue.on_duplicate != "skip":
            return None
        while (ahead := self._songs.claim((digest, key), job.id)) is not None:
            log.info("%s is the same song as job %s, in flight with the same settings: "
                     "waiting for it", Path(job.source).name, ahead[0])
            while not ahead[1].wait(0.1):
                control.check()
        for folder in map(Path, self._published(digest, key)):
            manifest = publish.read_manifest(folder) or {}
            source = manifest.get("input")
            if (isinstance(source, dict) and source.get("sha256") == digest
                    and settings_key_of(manifest.get("settings")) == key):
                self._songs.release(job.id)
                return folder
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
            else:
                choices.move_sidecar(source, moved_to)
        return self._update(job.id, state=JobState.DONE, progress=1.0, output=str(output),
                            source=str(moved_to), error=error, stage=None,
                            finished_at=time.time())


def _nothing() -> None:
    """A playlist link's step has nothing to mark: its state is its entries'."""


def _clean(folders: Folders, scratch: Path, staging: Path) -> None:
    publish.remove_tree(scratch)
    publish.remove_tree(staging)
    publish.remove_if_empty(folders.staging)


class _Progress:
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
