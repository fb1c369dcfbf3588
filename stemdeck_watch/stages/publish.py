"""Turn separated stems into a finished song folder, all or nothing.

Everything for one song — stems, mixes, `stemdeck.json` — is written into a hidden staging
folder inside the outbox (same filesystem), flushed, and renamed into `outbox/<name>/` in one
step, so a sync client never uploads half a result. The manifest (stages/manifest.py) is
written last and names the job.

Stems are read from the worker's scratch files and written block by block (mixes summed block
by block), so publishing a song of any length takes the same memory. On the way each block may
be resampled (`output.samplerate`) and feed the preview's peaks and the loudness meters; file
names come from the layout template filled with sanitised tags (stages/naming.py), flac/mp3
stems are tagged (stages/tags.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.core.errors import FilesystemError, PublishError
from stemdeck_watch.core.paths import fsync_dir
from stemdeck_watch.stages import naming, resample, tags as tagging
from stemdeck_watch.stages.levels import LoudnessMeter, song_gain, to_db
from stemdeck_watch.stages.preview import Peaks
from stemdeck_watch.stages.scratch import BLOCK_FRAMES, AudioReader
from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.util.folders import Folder, open_folders
from stemdeck_watch.util.safefile import open_new
from stemdeck_watch.util.safetext import numbered_name

log = logging.getLogger(__name__)

EXTENSIONS = {"wav": "wav", "flac": "flac", "mp3": "mp3"}
PUBLISH_BLOCK = 4 * BLOCK_FRAMES  # frames per block written (~6 s at 44.1 kHz)
# outputs of a song written at once: while a song is written the worker is idle or separates
# the next song, so two shorten the wait without taking the machine from the worker
PUBLISH_THREADS = min(2, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class SongInfo:
    """What publish knows of the song besides its stems: its file name (the fallback for
    every tag), the input's tags, the preset, the input's rate and length, and the decoded
    input at the model's rate (scratch), which the stems' sum is compared with."""

    name: str
    tags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    preset: str | None = None
    input_samplerate: int | None = None
    input_frames: int | None = None
    source: Path | None = None

    @property
    def title(self) -> str:
        return str(self.tags.get("title") or self.name)


def plan_outputs(
    stems: dict[str, Path], sep: SeparationSettings, out: OutputSettings
) -> dict[str, tuple[str, list[str]]]:
    """Which files to write: output name → (kind, stems summed into it). A DAW project
    (`output.session`) gets the whole song as a mix for its reference track, unless one of
    `output.mixes` is that already."""
    sources = list(stems)
    if sep.two_stems:
        if sep.two_stems not in sources:
            raise PublishError(
                f"could not make two stems: separation.two_stems = {sep.two_stems!r}, but the "
                f"model {sep.model!r} separates {', '.join(sources)}; choose one of those"
            )
        outputs = {
            sep.two_stems: ("stem", [sep.two_stems]),
            f"no_{sep.two_stems}": ("stem", [s for s in sources if s != sep.two_stems]),
        }
    else:
        outputs = {s: ("stem", [s]) for s in sources}
    for mix, members in out.mixes.items():
        if mix.casefold() in {name.casefold() for name in outputs}:
            raise PublishError(
                f"could not make mix {mix!r}: output.mixes.{mix} has the name of a stem the "
                f"model {sep.model!r} writes ({', '.join(outputs)}); give the mix another name"
            )
        missing = [m for m in members if m not in sources]
        if missing:
            raise PublishError(
                f"could not make mix {mix!r}: output.mixes.{mix} names {', '.join(missing)}, but "
                f"the model {sep.model!r} separates {', '.join(sources)}"
            )
        outputs[mix] = ("mix", list(members))
    if out.session and not any(
        sorted(members) == sorted(sources) for kind, members in outputs.values() if kind == "mix"
    ):
        name = next(n for n in ("mix", "song_mix", "full_mix", "whole_mix") if n not in outputs)
        outputs[name] = ("mix", sources)
    return outputs


def write_song(
    staging: Path,
    stems: dict[str, Path],
    samplerate: int,
    name: str,
    sep: SeparationSettings,
    out: OutputSettings,
    block_frames: int = PUBLISH_BLOCK,
    info: SongInfo | None = None,
    peaks: dict[str, Peaks] | None = None,
    timings: dict[str, float] | None = None,
    levels: dict[str, Any] | None = None,
    also: list[list[str]] | None = None,
    threads: int = PUBLISH_THREADS,
    own: tuple[Mapping[str, str], Mapping[str, str]] | None = None,
    check: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Write every stem and mix into `staging`; returns the manifest's file entries, each
    with its integrated loudness (LUFS, None for silence).

    Streams: each output is read, summed (mixes, `no_<stem>`), resampled to
    `output.samplerate` and written `block_frames` at a time, so memory does not grow with
    the song. With `output.clip = "rescale"` every file is scaled by one factor, the song's,
    from the loudest output's peak (so the stems still add up to the mix), and the peaks are
    found first, in one pass over the stems, before anything is written; the same pass
    compares the stems' sum with the input (`info.source`). `peaks` (filled in here) gets
    one Peaks per stem for the preview; `timings` the seconds spent resampling and tagging;
    `levels` the song's gain and the residual (see stages/levels.py). `also` names sums of
    stems written elsewhere with the same gain (the stem file's): their peaks count too.
    Up to `threads` outputs are written at once. `own`: the other files and folders the
    song folder will hold (name → what it is), which no output may be named like. `check`
    raises to cancel; it is called before every block an output writes."""
    info = info or SongInfo(name)
    for level in (staging.parent, staging):
        _real_folder(level)
    plan = plan_outputs(stems, sep, out)
    readers = {stem: AudioReader(path) for stem, path in stems.items()}
    frames = min((r.frames for r in readers.values()), default=0)
    rate = resample.target_rate(out.samplerate, samplerate, info.input_samplerate, out.format)
    length = resample.target_frames(
        out.samplerate, rate, samplerate, frames, info.input_samplerate, info.input_frames
    )
    rescale = out.clip == "rescale" and not (out.format == "wav" and out.bit_depth == 32)
    gain, residual = song_gain(
        [m for _kind, m in plan.values()] + (also or []),
        readers,
        frames,
        block_frames,
        rescale,
        info.source,
        check,
    )
    if levels is not None:
        levels.update(
            {
                "gain": round(1.0 / gain, 6),
                "gain_db": to_db(1.0 / gain**2),
                "residual_db": residual.db if residual else None,
            }
        )
    values = naming.layout_values(name, info.tags, info.preset, sep.model, EXTENSIONS[out.format])
    names = {output: naming.stem_file(out.layout, output, values, staging) for output in plan}
    own_files, own_folders = own or ({MANIFEST: "the song's manifest"}, {})
    naming.check_distinct(
        {output: (plan[output][0], names[output]) for output in plan},
        own_files,
        own_folders,
        out.layout,
    )
    for filename in names.values():
        (staging / filename).parent.mkdir(parents=True, exist_ok=True)
    if peaks is not None:
        peaks.update(
            {output: Peaks(frames) for output, (kind, _) in plan.items() if kind == "stem"}
        )

    span = _Span(frames, block_frames, samplerate, rate, length)
    tagged = out.tags and out.format in tagging.TAGGED_FORMATS

    def write_one(output: str) -> tuple[dict[str, Any], float, float]:
        kind, members = plan[output]
        return _write_output(
            staging,
            names[output],
            output,
            kind,
            members,
            readers,
            span,
            out,
            gain,
            peaks.get(output) if peaks is not None else None,
            tagging.stem_tags(info.tags, info.name, output) if tagged else None,
            check,
        )

    # every output reads, sums, resamples, meters and writes on its own, mostly outside the
    # GIL (numpy, scipy's filters, libsndfile): the song's outputs in parallel, in plan order
    with ThreadPoolExecutor(max(1, min(threads, len(plan)))) as pool:
        written = list(pool.map(write_one, plan))
    if timings is not None:
        timings["resample"] = round(sum(seconds for _, seconds, _ in written), 3)
        timings["tags"] = round(sum(seconds for _, _, seconds in written), 3)
    return [entry for entry, _, _ in written]


@dataclasses.dataclass(frozen=True)
class _Span:
    """The frames an output is read and written in: `frames` at the model's `samplerate`
    in blocks of `block_frames`, written as `length` frames at `rate`."""

    frames: int
    block_frames: int
    samplerate: int
    rate: int
    length: int


def _write_output(
    staging: Path,
    filename: str,
    output: str,
    kind: str,
    members: list[str],
    readers: dict[str, AudioReader],
    span: _Span,
    out: OutputSettings,
    gain: float,
    collector: Peaks | None,
    stem_tags: dict[str, str] | None,
    check: Callable[[], None] = lambda: None,
) -> tuple[dict[str, Any], float, float]:
    """One stem or mix written into `staging` (tagged with `stem_tags` unless None): its
    manifest entry, and the seconds spent resampling and tagging it."""
    path = staging / filename
    channels = readers[members[0]].channels
    resampling, tagging_time = resample.Timed(), resample.Timed()
    blocks = _output_blocks(readers, members, span.frames, span.block_frames, out, gain, collector)
    # resampled to `length` frames, the manifest's (at the model's own rate: cut or padded
    # to the input's frame count, unchanged otherwise); a resampler's ringing may overshoot
    # full scale by a hair, which the integer conversion (`pcm`) clips
    meter = LoudnessMeter(span.rate, channels)
    blocks = _metered(
        resample.resampled(blocks, span.samplerate, span.rate, channels, span.length, resampling),
        meter,
    )
    try:  # a stem about to be tagged is flushed to disk once, after its tags
        _write_audio(path, blocks, channels, span.rate, out, sync=stem_tags is None, check=check)
    except OSError as exc:
        raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
    if stem_tags is not None:
        with tagging_time:
            tagging.write_tags(path, out.format, stem_tags)
    if path.parent != staging:
        fsync_dir(path.parent)  # a song subfolder made by output.layout
    entry = {
        "name": output,
        "kind": kind,
        "file": filename,
        "sources": members,
        "samplerate": span.rate,
        "channels": channels,
        "frames": span.length,
        "duration": round(span.length / span.rate, 6),
        "loudness": meter.integrated(),
    }
    return entry, resampling.seconds, tagging_time.seconds


def _checked(blocks: Iterable[np.ndarray], check: Callable[[], None]) -> Iterator[np.ndarray]:
    """The blocks, `check` called before each is made."""
    iterator = iter(blocks)
    while True:
        check()
        try:
            block = next(iterator)
        except StopIteration:
            return
        yield block


def _metered(blocks: Iterable[np.ndarray], meter: LoudnessMeter) -> Iterator[np.ndarray]:
    """The blocks as they are written, measured on the way."""
    for block in blocks:
        meter.add(block)
        yield block


def _output_blocks(
    readers: dict[str, AudioReader],
    members: list[str],
    frames: int,
    block_frames: int,
    out: OutputSettings,
    gain: float,
    peaks: Peaks | None,
) -> Iterator[np.ndarray]:
    """One output's blocks at the model's rate, clipping handled; the preview sees them."""
    for start, stop in _spans(frames, block_frames):
        block = _prevent_clip(_sum_block(readers, members, start, stop), out, gain)
        if peaks is not None:
            peaks.add(start, block)
        yield block


def _spans(frames: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(frames, start + size)) for start in range(0, frames, size)]


def _sum_block(
    readers: dict[str, AudioReader], members: list[str], start: int, stop: int
) -> np.ndarray:
    """One block of an output: its first member plus the others, in order (float32)."""
    audio = readers[members[0]].read(start, stop, interleaved=True)
    for member in members[1:]:
        audio += readers[member].read(start, stop, interleaved=True)
    return audio


def _prevent_clip(audio: np.ndarray, out: OutputSettings, divisor: float = 1.0) -> np.ndarray:
    """`divisor` is the whole file's (from `_gains`): one block never decides it alone."""
    if out.format == "wav" and out.bit_depth == 32:
        return audio  # float samples hold values beyond ±1 without damage
    if out.clip == "clamp":
        return np.clip(audio, -1.0, 1.0)
    return audio / divisor


def pcm(audio: np.ndarray, bits: int) -> np.ndarray:
    """A (channels, n) float block as (n, channels) integer samples of `bits` (16 or 24):
    round(x * 2^(bits-1)), clipped to the format's range. 24-bit samples are the top three
    bytes of an int32, the way libsndfile takes them. Converting here rather than in
    libsndfile halves the CPU a wav stem costs, and gives every format the same samples
    (libsndfile rounds a wav's down and a flac's to the nearest)."""
    scale = float(1 << (bits - 1))  # a power of two: x * scale is exact in float32
    scaled = np.empty(audio.shape[::-1], np.float32)
    np.multiply(audio.T, scale, out=scaled)
    np.rint(scaled, out=scaled)
    np.clip(scaled, -scale, scale - 1, out=scaled)
    if bits == 16:
        return scaled.astype(np.int16)
    return scaled.astype(np.int32) << 8


def _write_audio(
    path: Path,
    blocks: Iterable[np.ndarray],
    channels: int,
    samplerate: int,
    out: OutputSettings,
    sync: bool = True,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Write (channels, n) float blocks to `path` in the configured format, as they come;
    `sync` flushes the file to disk. `check` (raises to cancel) is called before every
    block: every writer of a song folder stops within a block, whatever makes the blocks."""
    blocks = _checked(blocks, check)
    if out.format == "mp3":
        import lameenc

        encoder = lameenc.Encoder()
        encoder.set_bit_rate(out.mp3_bitrate)
        encoder.set_in_sample_rate(samplerate)
        encoder.set_channels(channels)
        encoder.set_quality(2)
        with open_new(path) as handle:  # new in the staging folder: never through a link
            for audio in blocks:
                handle.write(encoder.encode(pcm(audio, 16).tobytes()))
            handle.write(encoder.flush())
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        return
    import soundfile

    subtype = {16: "PCM_16", 24: "PCM_24", 32: "FLOAT"}[out.bit_depth]
    # unbuffered, so that seeking never flushes (and fails) inside libsndfile's callbacks
    with open_new(path, buffering=0) as handle:
        guarded = _GuardedFile(handle)
        try:
            with soundfile.SoundFile(
                guarded, "w", samplerate, channels, subtype=subtype, format=out.format.upper()
            ) as sound:
                for audio in blocks:
                    sound.write(audio.T if out.bit_depth == 32 else pcm(audio, out.bit_depth))
        except Exception:
            if guarded.error is not None:
                raise guarded.error from None
            raise
        if guarded.error is not None:  # the header, rewritten at close
            raise guarded.error
        if sync:
            os.fsync(handle.fileno())


class _GuardedFile:
    """The file soundfile writes through (its virtual I/O): an OSError (a full disk) must not
    be raised inside libsndfile's C callbacks, where Python can only print it and soundfile
    then fails with a bare AssertionError. Short writes are completed; the first error is
    kept, the write reports what got written, and `_write_audio` raises the kept error with
    its errno and message."""

    def __init__(self, handle: Any):
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view) and self.error is None:
            try:  # an unbuffered write may be short (the disk filling up): go on
                done += self._handle.write(view[done:]) or 0
            except OSError as exc:
                self.error = exc
        return done

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def read(self, size: int = -1) -> bytes:
        return self._handle.read(size)


def publish_folder(staging: Path, outbox: Path, folders: Sequence[str], name: str) -> Path:
    """Rename the finished staging folder to `outbox`/`folders`…/`name` (or `name (2)`…);
    never over anything, never through a link planted in the outbox (a subfolder reached
    through it would put the song anywhere), never inside another song's folder (an album
    folder `Live` where the song `Live` was published goes to `Live (2)`)."""
    try:
        with open_folders(outbox, folders, taken=_holds_a_song) as parent:
            number = 1
            while True:
                candidate = numbered_name(name, number, keep_suffix=False)
                number += 1
                if parent.exists(candidate):
                    continue
                try:
                    parent.move_in(staging, candidate)
                except OSError:
                    if parent.exists(candidate):  # taken between the check and the rename
                        continue
                    raise
                break
            parent.sync()
    except OSError as exc:
        target = outbox.joinpath(*folders, name)
        raise PublishError(str(FilesystemError("move", staging, target, reason=exc))) from exc
    return parent.path / candidate


def _real_folder(path: Path) -> None:
    """`path` made a folder of its own: the staging folders are the service's, in a shared
    outbox, so a link or file planted at that name is removed (never written through)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(parents=True)
    if path.is_symlink() or not path.is_dir():
        log.warning("removing %s, which was put where the service keeps its own folder", path)
        path.unlink()
        path.mkdir()


def _holds_a_song(folder: Folder) -> bool:
    return folder.exists(MANIFEST)


def remove_tree(path: Path) -> None:
    """Remove a staging or scratch folder; a leftover is logged, never fatal."""
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove %s completely", path)


def remove_if_empty(path: Path) -> None:
    """Drop the hidden staging folder between songs, so the outbox shows only songs."""
    try:
        path.rmdir()
    except OSError:
        pass
