"""Everything that goes into one song folder besides the manifest: stems and mixes (publish),
the beat grid (`beats.json`), the picture (`preview.png`) and the DAW projects (session),
each optional step timed.

The runner calls `make_song_folder` with the staging folder and the worker's stems; the
returned entries, manifest fields and timings go into `stemdeck.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from stemdeck_watch.core.config import OutputSettings, SeparationSettings, Settings
from stemdeck_watch.core.errors import Cancelled, FilesystemError, PublishError
from stemdeck_watch.stages import practice, publish, stemfile
from stemdeck_watch.stages.decode import DecodedAudio
from stemdeck_watch.stages.preview import Peaks, draw_preview
from stemdeck_watch.stages.scratch import AudioReader
from stemdeck_watch.stages.practice import write_practice
from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.stages.session import project_file, write_sessions
from stemdeck_watch.util.safefile import open_new

log = logging.getLogger(__name__)

BEATS = "beats.json"
PREVIEW = "preview.png"


@dataclasses.dataclass
class SongFolder:
    entries: list[dict[str, Any]]  # the manifest's "stems"
    # "tags", "levels", "stem_file", "beat_grid", "preview", "practice", "session"
    manifest: dict[str, Any]
    # seconds per step: write, resample, tags, stem_file, beat_grid, preview, practice, session
    timings: dict[str, float]


def needs_beat_grid(out: OutputSettings) -> bool:
    """Whether publishing finds the beat grid: for beats.json, or for a DAW project's tempo
    and first beat or the practice click (then it costs the same, librosa included, without
    the file)."""
    return out.beat_grid or bool(out.session) or out.practice


def warm(settings: Settings) -> None:
    """Load the beat tracker now if the settings or a preset will find beat grids, so the
    first song does not wait for it (stages/beats.py). A failure only means the first song
    loads it: logged, never raised."""
    outputs = [settings.for_preset(name)[1] for name in (None, *settings.presets)]
    if not any(needs_beat_grid(out) for out in outputs):
        return
    from stemdeck_watch.stages import beats

    try:
        beats.warm()
    except Exception as exc:
        log.warning("could not load the beat tracker ahead (the first song will): %s", exc)


def extra_bytes(stems: int, out: OutputSettings, seconds: float) -> int:
    """What a song folder holds besides its stems and mixes, for the disk check: the DJ stem
    file (five AAC streams) and the practice renders (a click, the song minus each stem and
    each slowed version, as mp3s), for `seconds` of audio. The beat grid, the preview and the
    DAW projects are a few kilobytes."""
    total = 0
    if out.stem_file:
        total += int(5 * stemfile.BITRATE / 8 * seconds)
    if out.practice:
        played = seconds * (1 + stems) + sum(seconds * 100 / pct for pct in out.practice_speeds)
        total += int(practice.BITRATE * 125 * played)
    return total


def own_files(name: str, out: OutputSettings) -> tuple[dict[str, str], dict[str, str]]:
    """The files and the folders a song folder holds besides its stems and mixes (name →
    what it is): no stem or mix may take one of these names."""
    files = {MANIFEST: "the song's manifest"}
    if out.beat_grid:
        files[BEATS] = "the beat grid"
    if out.preview:
        files[PREVIEW] = "the preview picture"
    if out.stem_file:
        files[stemfile.file_name(name)] = "the DJ stem file"
    for kind in out.session:
        files[project_file(name, kind)] = f"the {kind} project"
    folders = {practice.FOLDER: "the practice folder"} if out.practice else {}
    return files, folders


def song_info(name: str, preset: str | None, decoded: DecodedAudio) -> publish.SongInfo:
    """The input's tags (read while decoding), its own rate and length, and the decoded
    input the stems' sum is compared with."""
    return publish.SongInfo(
        name=name,
        tags=decoded.tags,
        preset=preset,
        input_samplerate=decoded.source_samplerate,
        input_frames=decoded.source_frames,
        source=decoded.path,
    )


def make_song_folder(
    staging: Path,
    stems: dict[str, Path],
    samplerate: int,
    info: publish.SongInfo,
    sep: SeparationSettings,
    out: OutputSettings,
    check: Callable[[], None] = lambda: None,
) -> SongFolder:
    """Write the stems, mixes, beat grid and preview of one song into `staging`. `check`
    raises to cancel; it is called between steps, before every block a file is written in
    and inside the beat grid (an hour of audio takes it tens of seconds), so a cancel ends
    the writing within a block, whatever is being written."""
    timings: dict[str, float] = {}
    peaks: dict[str, Peaks] | None = {} if out.preview else None
    levels: dict[str, Any] = {}
    slots = stemfile.slot_members(list(stems)) if out.stem_file else None
    # the beat grid reads the stems, not the files made from them: found while they are
    # written (librosa, like the writers, runs mostly outside the GIL)
    grid_step = find_beat_grid if needs_beat_grid(out) else None
    with _beside(grid_step, stems, samplerate, check=check) as grid_job:
        started = time.perf_counter()
        entries = publish.write_song(
            staging,
            stems,
            samplerate,
            info.name,
            sep,
            out,
            info=info,
            peaks=peaks,
            timings=timings,
            levels=levels,
            also=[list(stems), *slots.values()] if slots else None,
            own=own_files(info.name, out),
            check=check,
        )
        timings["write"] = round(time.perf_counter() - started, 3)
        manifest: dict[str, Any] = {"tags": dict(info.tags), "levels": levels}
        if out.stem_file:
            check()
            started = time.perf_counter()
            manifest["stem_file"] = stemfile.write_stem_file(
                staging, stems, samplerate, levels["gain"], info.name, info.tags, check
            )
            timings["stem_file"] = round(time.perf_counter() - started, 3)
        check()
        grid: dict[str, Any] | None = None
        if grid_job:
            grid, timings["beat_grid"] = grid_job.result()
            if out.beat_grid:
                manifest["beat_grid"] = save_beat_grid(staging / BEATS, grid)
    if peaks is not None:
        started = time.perf_counter()
        seconds = entries[0]["duration"] if entries else 0.0
        try:
            draw_preview(staging / PREVIEW, peaks, info.title, seconds)
        except OSError as exc:
            raise PublishError(
                str(FilesystemError("write", staging / PREVIEW, reason=exc))
            ) from exc
        manifest["preview"] = PREVIEW
        timings["preview"] = round(time.perf_counter() - started, 3)
    if out.practice:
        check()
        started = time.perf_counter()
        manifest["practice"] = write_practice(
            staging,
            stems,
            samplerate,
            levels["gain"],
            grid,
            out.practice_speeds,
            info.name,
            info.tags,
            out,
            check,
        )
        timings["practice"] = round(time.perf_counter() - started, 3)
    if out.session:
        started = time.perf_counter()
        manifest["session"] = write_sessions(
            staging, out.session, entries, grid, info.name, info.tags
        )
        timings["session"] = round(time.perf_counter() - started, 3)
    return SongFolder(entries, manifest, timings)


@contextlib.contextmanager
def _beside(
    step: Callable[..., dict[str, Any]] | None, *args: Any, check: Callable[[], None]
) -> Iterator[Future[tuple[dict[str, Any], float]] | None]:
    """While inside, `step(*args, check)` runs on a thread of its own; the future gives its
    result and the seconds it took (None without a step). Leaving on an error stops it at its
    next check (the song folder failed: no use going on) and waits for it to end."""
    if step is None:
        yield None
        return
    stopped = threading.Event()

    def stoppable() -> None:
        check()
        if stopped.is_set():
            raise Cancelled("the song folder failed")

    def timed() -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        result = step(*args, stoppable)
        return result, round(time.perf_counter() - started, 3)

    with ThreadPoolExecutor(1, thread_name_prefix="song-folder") as pool:
        try:
            yield pool.submit(timed)
        except BaseException:
            stopped.set()
            raise


def find_beat_grid(
    stems: dict[str, Path], samplerate: int, check: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """The beat grid from the drums stem when the model has one, else from the mix (every
    stem summed). Never fails the song: without librosa the grid is empty and says why."""
    source = "drums" if "drums" in stems else "mix"
    readers = (
        [AudioReader(stems["drums"])]
        if source == "drums"
        else [AudioReader(p) for p in stems.values()]
    )
    try:
        from stemdeck_watch.stages.beats import beat_grid

        grid = beat_grid(readers, samplerate, source, check)
    except ImportError as exc:
        log.warning("no beat grid: %s (install librosa)", exc)
        grid = {
            "source": source,
            "tempo": None,
            "beats": [],
            "downbeats": [],
            "notes": [f"no beat grid: {exc}; install librosa"],
        }
    return grid


def write_beat_grid(
    path: Path, stems: dict[str, Path], samplerate: int, check: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """`beats.json` from the stems (see find_beat_grid); returns the manifest's summary."""
    return save_beat_grid(path, find_beat_grid(stems, samplerate, check))


def save_beat_grid(path: Path, grid: dict[str, Any]) -> dict[str, Any]:
    """`beats.json`; returns the manifest's summary."""
    try:
        with open_new(path, "w", encoding="utf-8") as handle:
            json.dump(grid, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
    return {
        "file": path.name,
        "source": grid["source"],
        "tempo": grid["tempo"],
        "beats": len(grid["beats"]),
        "notes": grid["notes"],
    }
