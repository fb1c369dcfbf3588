"""Practice renders: small mp3s in `<song>/practice/` to play along with on a phone.

- a click track from the beat grid, with a count-in of one bar;
- "minus STEM" for every stem: the song without it, with the click (play the part yourself);
- the song slowed down (`output.practice_speeds`, e.g. 75 %), pitch kept, with the click at
  the slowed tempo: Rubber Band's time-stretcher (through pedalboard) in its offline mode.

Every file starts with the same one-bar count-in (silence under four clicks, the first one
accented) before the song, so the first beat of the song falls on the next bar. Without a
beat (no grid, or none found) there is no click and no count-in; the note says so.

Files are named "NN Title - what.mp3" and tagged with the album "Title (practice)" and their
track number, so a phone's player lists them together, in order.

Memory does not grow with the song: the mixes are summed block by block from the scratch
stems, the clicks are rendered per block, and the time-stretcher works on chunks of
CHUNK_SECONDS with context on both sides, the seams crossfaded (both sides of a seam are
renderings of the same audio on the same time line, so they agree).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from stemdeck_watch.core.config import OutputSettings
from stemdeck_watch.core.errors import FilesystemError, PublishError
from stemdeck_watch.stages import publish, tags as tagging
from stemdeck_watch.stages.naming import clean_text, song_file
from stemdeck_watch.stages.scratch import BLOCK_FRAMES, AudioReader

FOLDER = "practice"
BITRATE = 128  # kbit/s: small files for a phone
BEATS_PER_BAR = 4  # librosa marks beats, not bars: a 4/4 count-in and accent
MUSIC_LEVEL, CLICK_LEVEL = 0.8, 0.35  # the click sits on top of the song without clipping
CLICK_SECONDS = 0.03
# time-stretched at a time: one call of Rubber Band cannot be interrupted, so a chunk (with
# its context) is what a cancel waits for at most (14 s of audio: about 1.4 s on a slow
# 2-core CPU), while the context stretched twice adds 40 % to the chunk's own work
CHUNK_SECONDS = 10.0
CONTEXT_SECONDS = 2.0  # on each side of a chunk, so its edges are stretched as in the song
FADE_SECONDS = 0.1  # crossfade at a seam
SEAM_SLIP = 0.01  # seconds a seam may shift the audio to meet in phase (and in all)


@dataclasses.dataclass(frozen=True)
class Clicks:
    """Click onsets (frames, in the rendered file) and which are accented."""

    onsets: np.ndarray
    accents: np.ndarray
    samplerate: int

    def block(self, start: int, stop: int, channels: int) -> np.ndarray:
        """The clicks sounding in frames [start, stop), as (channels, n)."""
        out = np.zeros(stop - start, np.float32)
        length = round(CLICK_SECONDS * self.samplerate)
        first = np.searchsorted(self.onsets, start - length, side="left")
        last = np.searchsorted(self.onsets, stop, side="left")
        for onset, accent in zip(self.onsets[first:last], self.accents[first:last], strict=True):
            wave = _click(self.samplerate, bool(accent))
            lo, hi = max(start, onset), min(stop, onset + length)
            if hi > lo:
                out[lo - start : hi - start] += wave[lo - onset : hi - onset]
        return np.broadcast_to(out, (channels, out.size))


def _click(samplerate: int, accent: bool) -> np.ndarray:
    t = np.arange(round(CLICK_SECONDS * samplerate)) / samplerate
    pitch = 1600.0 if accent else 1000.0
    return (np.sin(2 * np.pi * pitch * t) * np.exp(-t * 150)).astype(np.float32)


def click_plan(
    grid: Mapping[str, Any] | None, speed: float, samplerate: int
) -> tuple[Clicks, int] | None:
    """The clicks of a file at `speed` (1 = the song's own) and its count-in in frames, or
    None without a beat grid: one bar of BEATS_PER_BAR clicks at the first beat's place,
    then the song (shifted by that bar) with a click on every beat, every 4th accented."""
    beats = [float(b) for b in (grid or {}).get("beats") or []]
    tempo = (grid or {}).get("tempo")
    if len(beats) < 2 or not tempo:
        return None
    beat = 60.0 / float(tempo) / speed
    count_in = BEATS_PER_BAR * beat
    first = beats[0] / speed
    times = [first + k * beat for k in range(BEATS_PER_BAR)]
    times += [b / speed + count_in for b in beats]
    accents = [k == 0 for k in range(BEATS_PER_BAR)]
    accents += [i % BEATS_PER_BAR == 0 for i in range(len(beats))]
    onsets = np.round(np.array(times) * samplerate).astype(np.int64)
    return Clicks(onsets, np.array(accents), samplerate), round(count_in * samplerate)


def with_clicks(
    music: Iterator[np.ndarray], clicks: Clicks | None, count_in: int, channels: int
) -> Iterator[np.ndarray]:
    """The count-in, then the music, the clicks on top."""
    position = 0
    for start in range(0, count_in, BLOCK_FRAMES):
        stop = min(count_in, start + BLOCK_FRAMES)
        yield _mixed(np.zeros((channels, stop - start), np.float32), clicks, start)
        position = stop
    for block in music:
        yield _mixed(block, clicks, position)
        position += block.shape[1]


def _mixed(block: np.ndarray, clicks: Clicks | None, start: int) -> np.ndarray:
    if clicks is None:
        return block
    return MUSIC_LEVEL * block + CLICK_LEVEL * clicks.block(
        start, start + block.shape[1], block.shape[0]
    )


def stretched(
    read: Callable[[int, int], np.ndarray],
    frames: int,
    samplerate: int,
    speed: float,
    check: Callable[[], None] = lambda: None,
) -> Iterator[np.ndarray]:
    """frames [0, frames) of `read` played at `speed` (0.75 = 75 %), pitch kept, as blocks
    that add up to round(frames / speed) frames.

    Each chunk is stretched with CONTEXT_SECONDS of the song on both sides and overlaps the
    next by FADE_SECONDS. A phase vocoder's output depends on where it started, so two
    renderings of a seam agree in content but not in phase: the next chunk is shifted by up
    to SEAM_SLIP (the lag where the two correlate best) before the crossfade, as WSOLA does,
    and the shifts are kept from adding up to more than SEAM_SLIP in all."""
    from pedalboard import time_stretch

    chunk, context = round(CHUNK_SECONDS * samplerate), round(CONTEXT_SECONDS * samplerate)
    fade, slip = round(FADE_SECONDS * samplerate), round(SEAM_SLIP * samplerate)
    total = round(frames / speed)
    tail: np.ndarray | None = None
    drift = 0  # output position minus the position the content has in the song's time line
    emitted = 0
    for start in range(0, frames, chunk):
        check()
        stop = min(frames, start + chunk)
        keep_to = min(frames, stop + fade)  # this chunk's output overlaps the next one's
        lo, hi = max(0, start - context), min(frames, keep_to + context)
        out = time_stretch(
            np.ascontiguousarray(read(lo, hi), np.float32), samplerate, stretch_factor=speed
        )
        first = round(start / speed)
        last = total if keep_to >= frames else round(keep_to / speed)
        end = round((start - lo) / speed) + last - first  # where the kept part ends in `out`
        if out.shape[1] < end + slip:  # the stretcher rounded the length down
            out = np.pad(out, ((0, 0), (0, end + slip - out.shape[1])))
        begin = round((start - lo) / speed) + (emitted - drift - first)
        if tail is not None:
            lag = _best_lag(
                tail, out, begin, range(max(-slip, drift - slip), min(slip, drift + slip) + 1)
            )
            begin += lag
            drift -= lag
        piece = out[:, begin:end].copy()
        if tail is not None:
            n = tail.shape[1]
            ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
            piece[:, :n] = tail * (1 - ramp) + piece[:, :n] * ramp
        if keep_to < frames:
            overlap = last - round(stop / speed)
            tail, piece = piece[:, -overlap:], piece[:, :-overlap]
        else:  # the end: the shifts made it `drift` frames longer (or shorter)
            tail = None
            piece = piece[:, : max(0, piece.shape[1] - drift)]
            if drift < 0:
                piece = np.pad(piece, ((0, 0), (0, -drift)))
        emitted += piece.shape[1]
        if piece.shape[1]:
            yield piece


def _best_lag(tail: np.ndarray, out: np.ndarray, begin: int, lags: range) -> int:
    """The lag in `lags` where `out` from `begin` + lag looks most like `tail` (normalised
    cross-correlation of the mono signals)."""
    n = tail.shape[1]
    lo = max(0, begin + lags.start)
    region = out[:, lo : begin + lags.stop - 1 + n].mean(axis=0).astype(np.float64)
    target = tail.mean(axis=0).astype(np.float64)
    if region.size < n or not target.any():
        return 0
    scores = np.correlate(region, target, mode="valid")
    energy = np.convolve(region**2, np.ones(n), mode="valid")
    scores = scores / np.sqrt(np.maximum(energy, 1e-12))
    best = int(np.argmax(scores))
    lag = lo - begin + best
    return lag if lag in lags else 0


def _mix_blocks(
    readers: dict[str, AudioReader],
    members: list[str],
    frames: int,
    gain: float,
    check: Callable[[], None],
) -> Iterator[np.ndarray]:
    for start in range(0, frames, BLOCK_FRAMES):
        check()
        yield _mix(readers, members, gain, start, min(frames, start + BLOCK_FRAMES))


def _mix(
    readers: dict[str, AudioReader], members: list[str], gain: float, start: int, stop: int
) -> np.ndarray:
    audio = np.sum([readers[m].read(start, stop) for m in members], axis=0)
    return (gain * audio).astype(np.float32)


def write_practice(
    staging: Path,
    stems: dict[str, Path],
    samplerate: int,
    gain: float,
    grid: Mapping[str, Any] | None,
    speeds: tuple[float, ...],
    name: str,
    tags: Mapping[str, Any],
    out: OutputSettings,
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write the practice files into `staging/practice/`; returns the manifest's
    "practice": the files in order (name, what, speed) and notes."""
    folder = staging / FOLDER
    folder.mkdir(exist_ok=True)
    readers = {stem: AudioReader(p) for stem, p in stems.items()}
    frames = min(r.frames for r in readers.values())
    channels = next(iter(readers.values())).channels
    title = clean_text(tags.get("title") or "") or clean_text(name) or "song"
    sources = list(stems)
    whole = functools.partial(_mix, readers, sources, gain)
    renders: list[tuple[str, float, Callable[[], Iterator[np.ndarray]]]] = []
    notes: list[str] = []
    if click_plan(grid, 1.0, samplerate) is None:
        notes.append("no click or count-in: the beat grid found no beat")
    else:
        renders.append(("click", 1.0, functools.partial(_silence, channels, frames)))
    for stem in sources:
        renders.append(
            (
                f"minus {stem}",
                1.0,
                functools.partial(
                    _mix_blocks, readers, [s for s in sources if s != stem], frames, gain, check
                ),
            )
        )
    for percent in speeds:
        renders.append(
            (
                f"{percent:g}% speed",
                percent / 100,
                functools.partial(stretched, whole, frames, samplerate, percent / 100, check),
            )
        )
    mp3 = dataclasses.replace(out, format="mp3", mp3_bitrate=BITRATE)
    files = []
    for number, (what, speed, music) in enumerate(renders, start=1):
        check()
        filename = song_file(title, f" - {what}.mp3", prefix=f"{number:02d} ")
        path = folder / filename
        plan = click_plan(grid, speed, samplerate)
        clicks, count_in = plan if plan else (None, 0)
        try:
            publish._write_audio(
                path,
                with_clicks(music(), clicks, count_in, channels),
                channels,
                samplerate,
                mp3,
                sync=False,
                check=check,
            )
        except OSError as exc:
            raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
        song_tags = tagging.stem_tags(tags, name, what)
        song_tags.update(album=f"{title} (practice)", tracknumber=f"{number}/{len(renders)}")
        tagging.write_tags(path, "mp3", song_tags)  # flushes it to disk
        files.append(
            {
                "file": f"{FOLDER}/{filename}",
                "what": what,
                "speed": speed,
                "count_in": round(count_in / samplerate, 4),
                "tempo": None if plan is None else round(float((grid or {})["tempo"]) * speed, 2),
            }
        )
    return {"folder": FOLDER, "files": files, "notes": notes}


def _silence(channels: int, frames: int) -> Iterator[np.ndarray]:
    """The song's length of silence: under the clicks, the click track."""
    for start in range(0, frames, BLOCK_FRAMES):
        yield np.zeros((channels, min(BLOCK_FRAMES, frames - start)), np.float32)
