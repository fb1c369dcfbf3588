"""One job through its stages, in the order they run:

    prepare   a link's download (a playlist link lists and queues its entries instead)
    decode    the input's hash (a song published before with these settings ends here),
              the model's load, the decode into scratch
    separate  the worker turns the decoded song into stems
    write     the song folder in staging: stems, tags, beat grid, preview, manifest
    publish   staging becomes the song's folder in the outbox
    file      the input moves to processed/

`Pipeline.run` runs them in this order. The worker is the scarce part, so the dispatcher runs
the same stages in two parts: `start` (prepare → separate, under the pipeline lock, which is
the second guard of "one job at a time" after the queue's single consumer) returns the job's
`Publishing`, whose `finish` (write → file) may run while the next job separates. The
Prefetcher runs `prepare` ahead for the head of the queue; what it made is claimed by the
job's own prepare and decode stages (prepared.py says when it is still good).

Between stages the job's cancel flag is checked; during the long steps the step itself is
registered on the job's JobControl, so a cancel stops it at once.

A job is queued with its input's signature, but the file may be replaced before the job
reads it: the job takes the signature of the version it actually read, so the check after
publishing ("changed while it was separated") compares against what was separated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterator

from stemdeck_watch.core import choices
from stemdeck_watch.core.config import MACHINE_KEYS, SERVICE_ONLY, Settings
from stemdeck_watch.core.recipes import KNOWN as RECIPES
from stemdeck_watch.core.errors import (
    Cancelled,
    DecodeError,
    FilesystemError,
    ModelError,
    StageError,
    WorkerDied,
)
from stemdeck_watch.core.events import EventBus, JobSeparated
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState, settings_key_of
from stemdeck_watch.core.paths import exists_or_unreachable, find_moved, is_unreachable, move_file
from stemdeck_watch.engine import faults as machine
from stemdeck_watch.engine.inflight import SongsInFlight
from stemdeck_watch.engine.jobrun import JobRun, Progress
from stemdeck_watch.engine.playlists import Playlists
from stemdeck_watch.engine.prepared import Prepared, signature_of, version_of
from stemdeck_watch.engine.recovery import find_published
from stemdeck_watch.engine.shares import ShareWatch
from stemdeck_watch.links.fetch import download
from stemdeck_watch.links.listing import Playlist
from stemdeck_watch.links.linkfile import read_link
from stemdeck_watch.stages import publish, songfolder
from stemdeck_watch.stages.manifest import read_manifest, recorded_sidecar, write_manifest
from stemdeck_watch.util.safefile import sha256_of
from stemdeck_watch.stages.decode import decode_to_file
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.separator import DemucsSettings, Lead, Separator

if TYPE_CHECKING:
    from stemdeck_watch.engine.diskguard import DiskGuard

log = logging.getLogger(__name__)

# Share of the job's progress bar each stage fills (a link's download takes its share from
# the separation's, so the bar only ever moves forward).
DOWNLOAD_SHARE, DECODE_SHARE, SEPARATE_SHARE = 0.15, 0.05, 0.90

# Hands over what `prepare` made (or is making) ahead for a job, reporting its progress from
# then on; None: nothing was prepared.
Claim = Callable[[Callable[[float], None]], Prepared | None]


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        client: Separator,
        bus: EventBus,
        update: Callable[..., Job],
        published: Callable[[str, str], list[str]] = lambda _sha, _key: [],
        songs: SongsInFlight | None = None,
    ):
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
        self.shares: ShareWatch | None = None  # set by the service: folders on a share

    # ------------------------------------------------------------ a job's life

    def run(self, job: Job, control: JobControl, claim: Claim | None = None) -> Job:
        """Every stage, in order; returns the finished job. Raises StageError or Cancelled."""
        publishing = self.start(job, control, claim)
        publishing.begin()
        return publishing.finish()

    def start(self, job: Job, control: JobControl, claim: Claim | None = None) -> Publishing:
        """The stages that need the worker, under the pipeline lock: prepare → decode →
        separate. Returns the rest of the job, which needs no worker. Raises StageError or
        Cancelled, with scratch and staging removed (so does the rest)."""
        run = self._new_run(job, control)
        with self._lock, self._discarded_on_error(run):
            try:
                self._prepare(run, claim)
                if not run.ended:
                    self._decode(run, claim)
                if not run.ended:
                    self._separate(run)
            except WorkerDied as exc:  # a machine fault: what this attempt ran with
                exc.plan = "" if run.plan.as_configured else run.plan.describe()
                raise
            except ModelError as exc:  # the drop chose the model: say where to change it
                origin = run.origins.get("separation.model", "config")
                if origin == "config":
                    raise
                raise ModelError(
                    f"{exc} (separation.model = {run.sep.model!r} was chosen by the {origin})",
                    details=exc.details,
                ) from exc
        return Publishing(self, run)

    def finish(self, run: JobRun) -> Job:
        """The stages after the worker: write → publish → file the input. Needs no worker:
        it may run while the next job separates."""
        try:
            try:
                if not run.ended:
                    self._write_and_publish(run)
            finally:
                self._clean(run)
            if run.output is None:  # a playlist link: its entries are queued, it waits for them
                return run.job
            # announced as done only once the hidden staging folder is gone too; checked
            # against the version of the input that was read
            return self.file_input(
                run.job, Path(run.job.source), run.output, run.note, sidecar=run.sidecar
            )
        finally:  # done (or failed) on record: a job waiting for this song looks again
            self._songs.release(run.job.id)

    # ------------------------------------------------------------ the stages

    def _prepare(self, run: JobRun, claim: Claim | None) -> None:
        """A link's download: the one made ahead if it is still the link's, else made now.
        A playlist link lists its entries and queues them; when it comes up again behind
        them, it ends the playlist here."""
        job, control = run.job, run.control
        if job.kind is not JobKind.LINK:
            return
        if self.playlists is not None and self.playlists.expanded(job):
            run.marks_publishing = False
            ended = self.playlists.finish(job, control)  # the playlist's last step
            if ended is not None and not control.commit():
                raise Cancelled(control.reason or "cancelled")
            run.end(*ended if ended else ())
            return
        run.start = DOWNLOAD_SHARE
        run.report.stage(JobState.DOWNLOADING, 0.0)
        started = time.monotonic()
        progress = lambda v: run.report.progress(DOWNLOAD_SHARE * v)  # noqa: E731
        prepared = claim(progress) if claim else None
        if prepared is not None and not prepared.made_from(run.source):
            if prepared.link is not None:
                log.info(
                    "%s changed after its download was prepared; fetching what it says now",
                    run.source.name,
                )
            publish.remove_tree(run.scratch)  # none of it is this link's
            prepared = None
        if prepared is None:
            prepared = self.prepare(job, control, progress, decode=False)
        run.prepared, run.read = prepared, prepared.link
        if prepared.playlist is not None:
            assert self.playlists is not None  # only then are playlists listed
            self.playlists.expand(job, prepared.playlist, control)
            run.marks_publishing = False
            run.end()
            return
        link = prepared.download
        assert link is not None
        run.timer.measure("download", started)
        control.check()
        if self.disk is not None:  # its length is known now: does all of it fit?
            self.disk.admit_download(job, link.path)
        run.job = self._update(job.id, name=link.title)  # the song is named by its title
        run.link, run.source = link, link.path

    def _decode(self, run: JobRun, claim: Claim | None) -> None:
        """Hash the input (a song published before with these settings ends here), load the
        job's model and decode the input for it, unless that was done ahead."""
        control, source = run.control, run.source
        run.report.stage(JobState.DECODING, run.start)
        if run.prepared is None and claim is not None:
            run.prepared = claim(lambda _v: None)  # a decode ahead in flight is waited for
        if run.link is None:
            run.read = signature_of(source)  # looked at before it is read: a later change shows
        queued = run.job.signature
        if run.read is not None and queued is not None and not queued.inode:
            run.read = run.read.without_inode()  # an inbox on a share: kept as it was queued
        run.job = job = dataclasses.replace(run.job, signature=run.read or queued)
        prepared = run.prepared
        try:
            run.digest = (prepared and prepared.sha256_for(source)) or sha256_of(source)
            run.size = source.stat().st_size
        except OSError as exc:
            control.check()  # taken away while we read it: a cancel, not a failure
            raise DecodeError(str(FilesystemError("read", source, reason=exc))) from exc
        # the song's settings: what a song can choose, not how this machine copes or where
        # models are downloaded from
        song = {
            k: v
            for k, v in dataclasses.asdict(run.sep).items()
            if k not in MACHINE_KEYS | SERVICE_ONLY
        }
        run.settings = {"separation": song, "output": dataclasses.asdict(run.out)}
        run.key = settings_key_of(run.settings) or ""
        copy = self._duplicate_of(job, run.digest, run.key, control)
        if copy is not None:
            log.info(
                "%s was separated before with the same settings: the stems are in %s",
                Path(job.source).name,
                copy,
            )
            run.end(copy, f"already separated with the same settings: the stems are in {copy}")
            return
        started = time.monotonic()
        run.model = model = self.client.ensure_model(
            run.sep.model,
            run.repo,
            control,
            precision=run.plan.precision(run.sep.precision),
            device=run.plan.device,
        )
        run.timer.measure("model", started)
        started = time.monotonic()
        run.decoded = (
            prepared.decoded_for(source, model.samplerate, model.audio_channels)
            if prepared
            else None
        )
        if run.decoded is None:
            run.decoded = decode_to_file(
                source,
                run.scratch / "input.npy",
                model.samplerate,
                model.audio_channels,
                control.check,
                lambda v: run.report.progress(run.start + DECODE_SHARE * v),
            )
        run.timer.measure("decode", started)
        control.check()

    def _separate(self, run: JobRun) -> None:
        """The worker separates the decoded song into `scratch/stems`."""
        job, control, sep, decoded, model = run.job, run.control, run.sep, run.decoded, run.model
        assert decoded is not None and model is not None
        base = run.start + DECODE_SHARE
        share = SEPARATE_SHARE - run.start
        # one registry write (a sync to disk) for both: between two jobs it is worker idle time
        run.report.stage(
            JobState.SEPARATING,
            base,
            sha256=run.digest,
            settings_key=run.key,
            signature=job.signature,
            made_by=_made_by(sep.recipe, sep.model, model.sources),
        )
        result = self.client.separate(
            job.id,
            sep.model,
            run.repo,
            decoded.path,
            run.scratch / "stems",
            control=control,
            demucs=DemucsSettings(sep.shifts, sep.overlap, sep.segment or None, decoded.stats),
            precision=model.dtype,
            stall_seconds=sep.stall_seconds,
            shrink=run.plan.shrink,
            device=run.plan.device,
            on_progress=lambda v: run.report.progress(base + share * v),
            lead=Lead(RECIPES[sep.recipe].vocals) if sep.recipe else None,
        )
        run.timer.timings["separate"] = round(result.seconds, 3)
        if sep.device not in ("auto", result.device):
            log.info(
                "%s: separated on %s, not on %s (separation.device, chosen by the %s): a "
                "song runs where the worker runs",
                job.name,
                result.device or "the worker's device",
                sep.device,
                run.origins.get("separation.device", "config"),
            )
        self.bus.publish(JobSeparated(job.id, result.worker_pid, result.seconds))
        control.check()
        run.separation = result

    def _mark_publishing(self, run: JobRun) -> None:
        """The job is publishing from now on (behind the worker, once the previous song's
        publish has ended: one song publishes at a time)."""
        if run.marks_publishing:
            run.control.check()
            run.report.stage(JobState.PUBLISHING, DECODE_SHARE + SEPARATE_SHARE)

    def _write(self, run: JobRun) -> None:
        """The song folder in staging: stems at output.samplerate, tags, beats.json and
        preview.png (timed each), then the manifest."""
        job, control, decoded, model, result = (
            run.job,
            run.control,
            run.decoded,
            run.model,
            run.separation,
        )
        assert decoded is not None and model is not None and result is not None
        control.check()
        info = songfolder.song_info(job.name, job.preset, decoded)
        song = songfolder.make_song_folder(
            run.staging, result.stems, model.samplerate, info, run.sep, run.out, check=control.check
        )
        run.timer.timings.update(song.timings)
        write_manifest(
            run.staging,
            {
                "job_id": job.id,
                "input": {
                    "name": Path(job.source).name,
                    "rel_path": job.rel_path,
                    "sha256": run.digest,
                    "size": run.size,
                    "codec": decoded.source_codec,
                    "samplerate": decoded.source_samplerate,
                    "channels": decoded.source_channels,
                    "duration": round(decoded.seconds, 6),
                },
                "model": {
                    "name": run.sep.model,
                    "repo": model.repo or None,
                    "samplerate": model.samplerate,
                    "sources": list(model.sources),
                    # which model made which stem (a recipe's lead made its stems)
                    "made_by": result.made_by or {s: run.sep.model for s in model.sources},
                },
                # the recipe (separation.recipe): its vocal model and the Demucs model for
                # the rest; null: the model alone
                "recipe": _recipe_manifest(run.sep.recipe, result.lead_compiled),
                "preset": job.preset,
                **({"link": run.link.manifest()} if run.link else {}),
                "settings": run.settings,
                # where each setting came from: config, preset, a tag in the name, a sidecar
                "settings_from": run.origins,
                # the sidecar the choices were read from, as it was then (null: none)
                "sidecar": (
                    {
                        "file": choices.sidecar_of(Path(job.source)).name,
                        "sha256": run.sidecar or None,
                    }
                    if run.sidecar is not None
                    else None
                ),
                "stems": song.entries,
                **song.manifest,
                "timings": run.timer.timings,
                "versions": self.client.versions,
                # where the worker separated it, as the worker said: not the setting, which
                # a worker started for the config's device (or a fallback) need not follow
                "device": result.device,
                # the precision the worker separated in, and the figures that chose it
                "precision": dict(model.precision) or {"precision": model.dtype},
                # whether the compiled model separated it, and where the compile stands
                "compiled": {**model.compiled, "used": result.compiled},
                # this was attempt N: the ones before it were cut off by the machine (the worker
                # died, stalled, ran out of memory), each recorded with its reason
                "attempts": len(job.faults) + 1,
                "faults": [fault.to_dict() for fault in job.faults],
                # after running out of memory: what this attempt separated with instead (the
                # window and segment in seconds, the device)
                **(
                    {}
                    if run.plan.as_configured
                    else {
                        "memory_plan": {
                            "plan": run.plan.describe(),
                            "shrink": run.plan.shrink,
                            **result.sizes(),
                        }
                    }
                ),
            },
        )

    def _publish(self, run: JobRun) -> None:
        """Staging becomes the song's folder in the outbox, after the last chance to cancel."""
        job, control, timings = run.job, run.control, run.timer.timings
        if not control.commit():  # last chance for a cancel: after this the song is out
            raise Cancelled(control.reason or "cancelled")
        folders = PurePosixPath(job.rel_path).parent.parts
        output = publish.publish_folder(run.staging, self.settings.paths.outbox, folders, job.name)
        log.info(
            "published %s → %s (decode %.1f s, separate %.1f s, write %.1f s)",
            run.source.name,
            output,
            timings["decode"],
            timings["separate"],
            timings["write"],
        )
        run.end(output)

    def _write_and_publish(self, run: JobRun) -> None:
        """write → publish. An outbox on a share that is away fails nothing: the stems stay
        in scratch, the queue pauses ("outbox"), and the song is written again once the
        outbox answers — unless its folder did appear (the rename went through, its answer
        was lost; or so before a stop, and the job runs again)."""
        job = run.job
        while True:
            shares = self.shares
            if shares is not None:
                shares.keep(run.staging)
                if not shares.check("outbox"):
                    self._wait_for_outbox(run, shares)
            existing = find_published(self.settings.paths.outbox, job)
            if existing is not None:  # an attempt before the outbox went away got through
                log.info("%s was published to %s before the outbox went away", job.name, existing)
                run.end(existing)
                return
            try:
                self._write(run)
                self._publish(run)
                return
            except (OSError, StageError) as exc:
                if shares is None or shares.check("outbox"):
                    raise
                log.warning("could not publish %s: %s", job.name, exc)

    def _wait_for_outbox(self, run: JobRun, shares: ShareWatch) -> None:
        log.warning(
            "the outbox %s cannot be reached: the stems of %s wait in scratch until it answers",
            self.settings.paths.outbox,
            run.job.name,
        )
        shares.wait_back("outbox", run.control)
        publish.remove_tree(run.staging)  # a half-written attempt

    def file_input(
        self,
        job: Job,
        source: Path,
        output: Path,
        note: str | None = None,
        sidecar: str | None = choices.ANY,
    ) -> Job:
        """Move the input to processed/ — only now that its stems are safely published —
        with the sidecar it was separated with (`sidecar`: its sha256, None for none; by
        default as the manifest in `output` records it). A sidecar that came or changed
        after the song started stays in the inbox, and the job's note says so."""
        error = note
        moved_to = source
        target = self.settings.paths.processed / PurePosixPath(job.rel_path)
        shares = self.shares
        try:
            found = exists_or_unreachable(source)
        except OSError as exc:
            return self._move_later(job, source, target, output, note, exc.strerror or str(exc))
        current = FileSignature.of(found) if found is not None else None
        if current is None and shares is not None and not shares.check("inbox"):
            return self._move_later(job, source, target, output, note, "the inbox is away")
        if current is not None and shares is not None and not shares.check("processed"):
            return self._move_later(job, source, target, output, note, "processed/ is away")
        if current is None:
            # gone: taken away, or moved here just before a crash cut off the registry write
            sig = job.signature
            moved = find_moved(target, sig.size, sig.mtime_ns) if sig else None
            moved_to = moved or source
            log.info(
                "%s is no longer in the inbox; %s",
                source,
                f"it is at {moved}" if moved else "nothing to move",
            )
        elif job.signature is not None and current != job.signature:
            error = (
                f"stems published, but {source} changed while it was separated, so it "
                f"stays in the inbox and will be separated again"
            )
            log.warning("%s", error)
        else:
            try:
                moved_to = move_file(
                    source,
                    target,
                    companion=choices.sidecar_of,
                    within=self.settings.paths.processed,
                )
            except FilesystemError as exc:
                if shares is not None and (
                    is_unreachable(exc)
                    or not shares.check("inbox")
                    or not shares.check("processed")
                ):
                    return self._move_later(job, source, target, output, note, str(exc))
                error = f"stems published, but {exc}; the input stays in the inbox"
                log.error("%s", error)
            else:
                if sidecar is choices.ANY:
                    sidecar = recorded_sidecar(output, job.id)
                left = choices.move_sidecar(source, moved_to, sidecar)
                error = "; ".join(filter(None, (error, left))) or None
        return self._update(
            job.id,
            state=JobState.DONE,
            progress=1.0,
            output=str(output),
            source=str(moved_to),
            error=error,
            stage=None,
            finished_at=time.time(),
        )

    def _move_later(
        self, job: Job, source: Path, target: Path, output: Path, note: str | None, why: str
    ) -> Job:
        """The song is done; its input could not be reached to move it (its share is
        away). The move is kept in the registry and done when the share answers: the
        input's final place is pending, and it is never taken for a song deleted."""
        if self.shares is not None:
            self.shares.defer_move(job.id, "processed", source, target, job.signature, why)
        else:
            note = (
                f"stems published, but {source} could not be reached to move it ({why}); "
                f"the input stays in the inbox"
            )
            log.error("%s", note)
        return self._update(
            job.id,
            state=JobState.DONE,
            progress=1.0,
            output=str(output),
            source=str(source),
            error=note,
            stage=None,
            finished_at=time.time(),
        )

    # ------------------------------------------------------------ work ahead of the worker

    def works_beside(self, job: Job) -> bool:
        """Whether to publish `job` behind the worker, or decode it ahead of it
        (`queue.work_beside`).

        "auto" does so where the worker leaves room (a GPU, or a core it does not use), and
        on a CPU the worker fills as long as `job` has no beat grid: there, beside the
        worker, the ten-clip run took 0.90x as long as serially; with the beat grid (and
        preview, tags) on it took 1.01x-1.18x as long, stretching separation 1.3x-1.6x, so
        the worker keeps the cores (docs, Benchmarks → Work beside the worker)."""
        mode = self.settings.queue.work_beside
        if mode != "auto":
            return mode == "on"
        _separation, output = choices.settings_for(self.settings, job)
        return self.client.leaves_room() or not songfolder.needs_beat_grid(output)

    def can_prepare(self, job: Job) -> bool:
        """Whether `prepare` has anything to do ahead for `job`: a link's download (it waits
        on the network, not the CPU), or a file's decode when work beside the worker pays
        and the worker holds the job's model already (decoding needs the model's rate and
        channels, and the worker is busy: no loading ahead)."""
        return job.kind is JobKind.LINK or (
            self.works_beside(job) and self._loaded_format(job) is not None
        )

    def prepare(
        self,
        job: Job,
        control: JobControl,
        on_progress: Callable[[float], None],
        decode: bool = True,
    ) -> Prepared:
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
            prepared.link = signature_of(link)  # before reading: a later edit shows as a change
            prepared.url = url = read_link(link)
            entry = job.playlist  # an entry of a playlist: its title and length are known
            got = download(
                url,
                self.settings.paths.scratch / job.id / "download",
                self.settings.links,
                control=control,
                on_progress=on_progress,
                link_name=link.name,
                playlist=entry,
                title=job.name if entry else None,
                expand=(
                    self.playlists is not None and entry is None and self.settings.links.playlists
                ),
            )
            if isinstance(got, Playlist):
                prepared.playlist = got
                return prepared
            prepared.download = got
            source = got.path
            if self.disk is not None:
                self.disk.learn_download(job, got.path)
        form = self._loaded_format(job) if decode else None
        if form is None or (
            job.kind is JobKind.LINK and self.disk is not None and not self.disk.fits_ahead(job)
        ):
            return prepared
        version = version_of(source)
        try:
            digest = sha256_of(source)
            decoded = decode_to_file(
                source,
                self.settings.paths.scratch / job.id / "input.npy",
                form[0],
                form[1],
                control.check,
            )
        except Cancelled:
            raise
        except Exception as exc:  # the job decodes again when it runs, and fails with the reason
            log.info("could not decode %s ahead (%s); it is decoded when it runs", source, exc)
            return prepared
        if version_of(source) == version:  # not changed while we read it
            prepared.sha256, prepared.decoded = digest, decoded
            prepared.version, prepared.format = version, form
        return prepared

    def _loaded_format(self, job: Job) -> tuple[int, int] | None:
        sep, _ = choices.settings_for(self.settings, job)
        repo = self.settings.resolve_model_repo(sep)
        model = self.client.model_info
        if model is None or (model.name, model.repo) != (sep.model, str(repo) if repo else None):
            return None
        return model.samplerate, model.audio_channels

    # ------------------------------------------------------------ helpers

    def _new_run(self, job: Job, control: JobControl) -> JobRun:
        # the sidecar as it was when the choices were read: one that comes or changes later
        # is not the song's (file_input leaves it in the inbox, saying so)
        sidecar = choices.sidecar_digest(Path(job.source))
        chosen = choices.for_job(self.settings, job)  # a bad tag or sidecar fails it now
        if choices.sidecar_digest(Path(job.source)) != sidecar:
            sidecar = ""  # which version was read is not known: none that is there now
        sep, out = chosen.separation, chosen.output
        repo = self.settings.resolve_model_repo(sep)
        folders = self.settings.paths
        plan = machine.plan_for(job.faults, sep)  # after memory faults: smaller, the CPU
        if not plan.as_configured:
            log.info(
                "%s: attempt %d after running out of memory: %s",
                job.name,
                len(job.faults) + 1,
                plan.describe(),
            )
        return JobRun(
            job,
            control,
            Progress(self._update, job.id),
            sep,
            out,
            str(repo) if repo else None,
            folders.scratch / job.id,
            folders.staging / job.id,
            Path(job.source),
            origins=chosen.origins,
            sidecar=sidecar,
            plan=plan,
        )

    @contextlib.contextmanager
    def _discarded_on_error(self, run: JobRun) -> Iterator[None]:
        """On any error: scratch and staging removed, the song no longer held in flight."""
        try:
            yield
        except BaseException:
            self._clean(run)
            self._songs.release(run.job.id)
            raise

    def _clean(self, run: JobRun) -> None:
        publish.remove_tree(run.scratch)
        publish.remove_tree(run.staging)
        shares = self.shares
        # a song that did not publish may have left its staging on a share that is away
        # (and comes back with it): the outbox is looked at for those alone
        if (
            run.output is None
            and shares is not None
            and (shares.away("outbox") or not shares.check("outbox"))
        ):
            shares.remove_when_back(run.staging)
        publish.remove_if_empty(self.settings.paths.staging)

    def _duplicate_of(self, job: Job, digest: str, key: str, control: JobControl) -> Path | None:
        """A complete outbox folder holding this content separated with these settings, by
        its manifest, if duplicates are skipped (`queue.on_duplicate`). The folder a done
        job published may hold another song by now (moved away, another published there).

        A job with the same song in flight is waited for: its end decides. Otherwise this
        job holds the song until it ends (SongsInFlight), so a copy behind it waits."""
        if self.settings.queue.on_duplicate != "skip":
            return None
        while (ahead := self._songs.claim((digest, key), job.id)) is not None:
            log.info(
                "%s is the same song as job %s, in flight with the same settings: waiting for it",
                Path(job.source).name,
                ahead[0],
            )
            while not ahead[1].wait(0.1):
                control.check()
        for folder in map(Path, self._published(digest, key)):
            manifest = self._published_manifest(folder, control)
            source = manifest.get("input")
            if (
                isinstance(source, dict)
                and source.get("sha256") == digest
                and settings_key_of(manifest.get("settings")) == key
            ):
                self._songs.release(job.id)
                return folder
        return None

    def _published_manifest(self, folder: Path, control: JobControl) -> dict[str, Any]:
        """The manifest of a folder published in the outbox. While the outbox's share is away
        it is waited for (a cancel, or the service stopping, raises meanwhile): an outbox
        that cannot be read says nothing about whether this song was separated before."""
        manifest = read_manifest(folder)
        shares = self.shares
        while manifest is None and shares is not None and not shares.check("outbox"):
            shares.wait_back("outbox", control)
            manifest = read_manifest(folder)
        return manifest or {}


class Publishing:
    """The rest of a job once the worker is done with it, as a plain object the dispatcher
    can hand to another thread.

    `begin` marks the job publishing. The dispatcher calls it on its own thread before it
    takes the next job, so nobody (status, the page, the tray) ever sees a song still
    separating beside the next one; `finish` writes, publishes and files the input, behind
    the worker or not."""

    def __init__(self, pipeline: Pipeline, run: JobRun):
        self.pipeline = pipeline
        self.run = run

    @property
    def job(self) -> Job:
        return self.run.job

    def begin(self) -> None:
        with self.pipeline._discarded_on_error(self.run):
            self.pipeline._mark_publishing(self.run)

    def finish(self) -> Job:
        return self.pipeline.finish(self.run)


def _recipe_manifest(name: str, compiled: dict[str, Any] | None) -> dict[str, Any] | None:
    """The recipe's models, and whether its RoFormer ran compiled and where that stands."""
    recipe = RECIPES.get(name)
    if recipe is None:
        return None
    found: dict[str, Any] = {"name": recipe.name, "vocals": recipe.vocals, "rest": recipe.rest}
    return {**found, "compiled": compiled} if compiled else found


def _made_by(recipe: str, model: str, sources: tuple[str, ...]) -> dict[str, str]:
    """Which model will make each stem: the recipe's, or the model alone."""
    found = RECIPES.get(recipe)
    return found.made_by(sources) if found else {stem: model for stem in sources}
